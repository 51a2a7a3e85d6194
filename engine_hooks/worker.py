"""A vLLM worker extension: snapshot, suspend/resume and group rebuild, called over ``collective_rpc``.

    llm = LLM(model, load_format="podsnap", model_loader_extra_config={"store": STORE},
              worker_extension_cls="podsnap.engine_hooks.worker.PodsnapWorkerExtension")
    llm.collective_rpc("podsnap_snapshot", args=("my-snapshot",))   # live state -> store
    llm.collective_rpc("podsnap_suspend")                           # free the weights (they are in the store)
    llm.collective_rpc("podsnap_resume")                            # map them back, rerun derivations
    llm.collective_rpc("podsnap_rebuild_comm", args=({"generation": 1, "master_addr": "10.0.0.7",
                                                      "port_base": 29500, "rank_map": {}},))
    llm.collective_rpc("podsnap_status")                            # what the loader did, per rank

vLLM mixes this class into its worker class, so ``self`` is the worker
(``self.model_runner``, ``self.vllm_config``, ``self.rank``). Every method
returns a JSON-able dict. Suspend keeps the KV cache allocated and does not
pause the scheduler: stop sending requests first (or use vLLM's sleep mode for
the KV cache). Resume re-allocates the weights, so on CUDA graphs captured
before the suspend would point at freed memory: unverified (no GPU here).
"""

from __future__ import annotations

from dataclasses import asdict, replace

import torch

from podsnap.errors import PodsnapError
from podsnap.restore.loader import load_rank
from podsnap.snapshot.store import Store, new_snapshot_id

from . import comm
from .capture import SnapshotRef, write_snapshot
from .derived_state import derivation_inputs, entry_for
from .identity import placement, requested_fingerprint
from .model_state import capture_state, fill_model, release


class PodsnapWorkerExtension:
    def _podsnap_model(self) -> torch.nn.Module:
        return self.model_runner.get_model()

    def _podsnap_entry(self):
        from vllm.platforms import current_platform

        return entry_for(current_platform.device_type)

    def _podsnap_ref(self) -> SnapshotRef:
        ref = getattr(self._podsnap_model(), "podsnap_snapshot", None)
        if ref is None:
            raise PodsnapError("this model's state is in no snapshot: load it with load_format='podsnap' "
                               "(which writes one) or call podsnap_snapshot first")
        return ref

    def podsnap_status(self) -> dict:
        """What the podsnap loader did on this rank, and the snapshot the model's state is in."""
        model = self._podsnap_model()
        report, ref = getattr(model, "podsnap_report", None), getattr(model, "podsnap_snapshot", None)
        return {"report": None if report is None else asdict(report),
                "snapshot": None if ref is None else {"store": str(ref.store), "snapshot": ref.snapshot_id,
                                                      "rank": ref.rank, "world": ref.world}}

    def podsnap_snapshot(self, name: str | None = None, store: str | None = None) -> dict:
        """Write the live model state as snapshot ``name`` (collective over the ranks).

        Tensors a derivation consumed (CPU GEMM weights inside their oneDNN handles) cannot be
        read back from the engine; their records are reused from the snapshot the model came from.
        """
        model, entry = self._podsnap_model(), self._podsnap_entry()
        ref = getattr(model, "podsnap_snapshot", None)
        if store is None and ref is None:
            raise PodsnapError("podsnap_snapshot needs a store: pass store=... or load with load_format='podsnap'")
        target = Store(store or ref.store)
        consumed = set(derivation_inputs(model, entry))
        if consumed and (ref is None or not consumed <= set(ref.records)):
            raise PodsnapError(f"{len(consumed)} tensor(s) of this model live only inside kernel handles (e.g. "
                               f"{sorted(consumed)[0]}); podsnap can snapshot them only for a model loaded with "
                               "load_format='podsnap'")
        if consumed and target.root.resolve() != ref.store.resolve():
            raise PodsnapError(f"this model's kernel-handle tensors are stored in {ref.store}; snapshot it there "
                               f"(not into {target.root})")
        where = placement()
        fp = ref.fingerprint if ref else requested_fingerprint(self.vllm_config, self.vllm_config.model_config,
                                                               target, entry)
        state, aliases = capture_state(model, entry, where.rank, where.world, {})
        state.tensors = [t for t in state.tensors if t.name not in consumed]
        reuse = [ref.records[n] for n in sorted(consumed)]
        snapshot_id = name or new_snapshot_id()
        extras = {"source": str(self.vllm_config.model_config.model), "live": True, "aliases": aliases,
                  "derivations": [d.name for d in entry.derivations]}
        record, stats = write_snapshot(target, snapshot_id, state, where, fp, self.vllm_config,
                                       self.vllm_config.model_config, extras, reuse)
        model.podsnap_snapshot = SnapshotRef(target.root, snapshot_id, where.rank, where.world, fp,
                                             {r.name: r for r in record.tensors})
        return {"snapshot": snapshot_id, "rank": where.rank, **stats.to_dict()}

    def podsnap_suspend(self) -> dict:
        """Free the model's tensors (they are in the snapshot ``podsnap_snapshot`` points at)."""
        ref = self._podsnap_ref()
        released = release(self._podsnap_model(), self._podsnap_entry())
        return {"snapshot": ref.snapshot_id, "rank": ref.rank, **asdict(released)}

    def podsnap_resume(self, verify: str = "full") -> dict:
        """Fill the model back from its snapshot and rebuild what the derivations make."""
        from .loader import target_device

        model, entry, ref = self._podsnap_model(), self._podsnap_entry(), self._podsnap_ref()
        store = Store(ref.store, create=False)
        manifest = store.load(ref.snapshot_id)
        rank = manifest.ranks[ref.rank]
        tensors, stats = load_rank(store, rank, verify)
        counts = fill_model(model, tensors, rank.tensors, manifest.extras.get("aliases", {}), entry,
                            target_device(self.vllm_config, self.vllm_config.load_config))
        model.podsnap_snapshot = replace(ref, records={r.name: r for r in rank.tensors})
        return {"snapshot": ref.snapshot_id, "rank": ref.rank, "bytes": stats.bytes, "seconds": stats.seconds,
                "derivations": counts}

    def podsnap_rebuild_comm(self, metadata: str | dict, timeout_s: float = 60.0) -> dict:
        """Rebuild vLLM's process groups for new addresses (a restore-metadata file path, or its content)."""
        return comm.rebuild(self, self._podsnap_model(), self._podsnap_entry(), metadata, timeout_s).to_dict()
