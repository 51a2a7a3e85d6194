"""``load_format="podsnap"``: restore vLLM's post-processed model from the store, or load it and snapshot it.

    fingerprint of this start (checkpoint tensor values, config, dtype, quant, parallel layout, versions)
      a snapshot matches    -> build the model on the meta device, fill every tensor from the store
                               (the warm-start loader, hash-verified), rerun the platform's derivations;
                               vLLM's load_weights and process_weights_after_loading do not run
      one of this model differs -> fallback on: log the differing fields, load as usual and write a
                               snapshot for this start; fallback off: fail with those fields
      none                  -> load as usual (vLLM's DefaultModelLoader, post-processing included),
                               then write the snapshot so the next start restores

The decision is agreed over the ranks (one small all-gather), so either all
ranks write the snapshot or none does. ``model.podsnap_report`` says what
happened; ``model.podsnap_snapshot`` is the snapshot the model's state is in.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
from vllm.utils.torch_utils import set_default_torch_dtype

from podsnap.errors import PodsnapError
from podsnap.restore.loader import load_rank
from podsnap.snapshot.store import Store

from .capture import SnapshotRef, gather, write_snapshot
from .derived_state import PlatformEntry, derivation_inputs, entry_for, uncovered, unregistered_tensor_attrs
from .identity import Lookup, Placement, find_snapshot, placement, requested_fingerprint
from .model_state import capture_state, fill_model
from .settings import LoaderSettings

logger = logging.getLogger("vllm.podsnap")  # a child of vLLM's logger: printed the way vLLM prints


class SnapshotRefused(PodsnapError):
    """No snapshot could be restored and fallback is off."""


@dataclass
class LoadReport:
    """What the loader did on this rank (``model.podsnap_report``)."""

    mode: str  # "restored" | "loaded"
    snapshot: str | None = None  # restored from, or written
    written: bool = False
    message: str | None = None  # why a snapshot was not restored or not written
    derivations: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0


class RecordingLoader(DefaultModelLoader):
    """vLLM's default loader that notes, between ``load_weights`` and post-processing, the tensors the
    platform's derivations will consume (so the snapshot can keep them). They stay referenced until the
    snapshot is written: on CPU, where oneDNN packs its own copy, that start briefly holds the linear
    weights twice."""

    def __init__(self, load_config, entry: PlatformEntry | None):
        super().__init__(load_config)
        self.entry = entry
        self.inputs: dict[str, torch.Tensor] = {}

    def load_weights(self, model: nn.Module, model_config) -> None:
        super().load_weights(model, model_config)
        if self.entry is not None:
            self.inputs = derivation_inputs(model, self.entry)


@dataclass
class Start:
    """One model load: where the state lives, and what this start is."""

    vllm_config: object
    model_config: object
    prefix: str
    store: Store
    entry: PlatformEntry
    where: Placement
    lookup: Lookup | None = None
    problem: str | None = None  # why no snapshot can be restored (mismatch, unidentifiable checkpoint)
    status: str = "absent"  # "match" | "problem" | "absent"
    may_write: bool = False


class PodsnapModelLoader(BaseModelLoader):
    def __init__(self, load_config):
        super().__init__(load_config)
        self.settings = LoaderSettings.parse(load_config.model_loader_extra_config)
        self.plain_config = replace(load_config, load_format="auto", model_loader_extra_config={})

    def download_model(self, model_config) -> None:
        DefaultModelLoader(self.plain_config).download_model(model_config)

    def load_weights(self, model: nn.Module, model_config) -> None:
        """In-place reload of an initialized model: from the checkpoint, as vLLM's default loader does."""
        DefaultModelLoader(self.plain_config).load_weights(model, model_config)

    def load_model(self, vllm_config, model_config, prefix: str = "") -> nn.Module:
        t0 = time.perf_counter()
        start = self.begin(vllm_config, model_config, prefix)
        if start.status == "match":
            try:
                return self.restore(start, t0)
            except Exception as e:  # noqa: BLE001 - any failed restore falls back (or fails) the same way
                start.problem = f"restoring snapshot {start.lookup.match.snapshot_id!r} failed: {type(e).__name__}: {e}"
        if start.problem:
            if not self.settings.fallback:
                raise SnapshotRefused(f"podsnap: {start.problem}. Fallback is off, so this start fails; set "
                                      "model_loader_extra_config fallback=true to load the checkpoint instead")
            logger.warning("podsnap: %s; loading the checkpoint instead (fallback on)", start.problem)
        return self.load_and_snapshot(start, self.settings.write and start.may_write, t0)

    def begin(self, vllm_config, model_config, prefix: str) -> Start:
        """Fingerprint this start, find its snapshot, and agree with the other ranks on what to do."""
        from vllm.platforms import current_platform

        start = Start(vllm_config, model_config, prefix, Store(self.settings.store),
                      entry_for(current_platform.device_type), placement())
        try:
            fp = requested_fingerprint(vllm_config, model_config, start.store, start.entry)
            start.lookup = find_snapshot(start.store, fp, str(model_config.model))
            start.problem = start.lookup.mismatch(start.store)
        except (PodsnapError, OSError) as e:  # e.g. a .bin-only checkpoint: fingerprints read safetensors
            start.problem = f"cannot fingerprint the checkpoint of {model_config.model!r}: {e}"
        start.status = "match" if start.lookup and start.lookup.match else "problem" if start.problem else "absent"
        try:
            statuses = gather(start.status, start.where)
        except PodsnapError as e:  # a parallel layout podsnap does not cover: the same on every rank
            start.lookup, start.problem, start.status, statuses = None, str(e), "problem", []
        # all ranks write the snapshot, or none (writing is collective); never over one that exists
        start.may_write = start.lookup is not None and bool(statuses) and "match" not in statuses
        return start

    def restore(self, start: Start, t0: float) -> nn.Module:
        with forgotten_on_failure(start.vllm_config):
            return self._restore(start, t0)

    def _restore(self, start: Start, t0: float) -> nn.Module:
        manifest = start.lookup.match
        if manifest.world_size != start.where.world:
            raise PodsnapError(f"snapshot {manifest.snapshot_id!r} has {manifest.world_size} rank(s), this start "
                               f"{start.where.world}")
        rank = manifest.ranks[start.where.rank]
        with set_default_torch_dtype(start.model_config.dtype):
            with torch.device("meta"):
                model = self.create_model(vllm_config=start.vllm_config, model_config=start.model_config,
                                          prefix=start.prefix)
        problems = uncovered(model, start.entry)
        if problems:
            raise PodsnapError(f"podsnap does not cover the post-processing of {problems[:3]}")
        tensors, stats = load_rank(start.store, rank, self.settings.verify, self.settings.load_mode)
        counts = fill_model(model, tensors, rank.tensors, manifest.extras.get("aliases", {}), start.entry,
                            target_device(start.vllm_config, self.load_config))
        model.podsnap_snapshot = SnapshotRef(start.store.root, manifest.snapshot_id, start.where.rank,
                                             start.where.world, manifest.fingerprint,
                                             {r.name: r for r in rank.tensors})
        model.podsnap_report = LoadReport("restored", manifest.snapshot_id, derivations=counts,
                                          seconds=time.perf_counter() - t0)
        logger.info("podsnap: restored snapshot %s (rank %d): %d tensors, %.1f MiB read in %.2f s (verify %s); "
                    "no checkpoint read, no post-processing; rerun: %s", manifest.snapshot_id, start.where.rank,
                    len(rank.tensors), stats.bytes / 2**20, stats.seconds, self.settings.verify, counts or "none")
        return model.eval()

    def load_and_snapshot(self, start: Start, write: bool, t0: float) -> nn.Module:
        loader = RecordingLoader(self.plain_config, start.entry if write else None)
        model = loader.load_model(vllm_config=start.vllm_config, model_config=start.model_config,
                                  prefix=start.prefix)
        report = LoadReport("loaded", message=start.problem)
        if write:
            problems = uncovered(model, start.entry) + [f"{n}: tensor attribute not in the derived-state registry"
                                                        for n in unregistered_tensor_attrs(model, start.entry)]
            if problems:
                report.message = f"no snapshot written: podsnap does not cover {problems[:3]}"
                logger.warning("podsnap: %s", report.message)
            else:
                self.write(start, model, loader.inputs, report)
        loader.inputs = {}
        report.seconds = time.perf_counter() - t0
        model.podsnap_report = report
        return model

    def write(self, start: Start, model: nn.Module, inputs: dict[str, torch.Tensor], report: LoadReport) -> None:
        from vllm.platforms import current_platform

        t = time.perf_counter()
        state, aliases = capture_state(model, start.entry, start.where.rank, start.where.world, inputs)
        extras = {"source": str(start.model_config.model), "platform": current_platform.device_type,
                  "derivations": [d.name for d in start.entry.derivations], "aliases": aliases}
        name, fp = start.lookup.name, start.lookup.requested
        try:
            record, stats = write_snapshot(start.store, name, state, start.where, fp, start.vllm_config,
                                           start.model_config, extras)
        except (PodsnapError, OSError) as e:
            report.message = f"snapshot {name!r} not written: {e}"
            logger.warning("podsnap: %s", report.message)
            return
        model.podsnap_snapshot = SnapshotRef(start.store.root, name, start.where.rank, start.where.world, fp,
                                             {r.name: r for r in record.tensors})
        report.snapshot, report.written = name, True
        logger.info("podsnap: wrote snapshot %s (rank %d): %d tensors, %.1f MiB (%.1f MiB new) in %.2f s",
                    name, start.where.rank, stats.tensors, stats.bytes_total / 2**20, stats.bytes_written / 2**20,
                    time.perf_counter() - t)


@contextmanager
def forgotten_on_failure(vllm_config):
    """If a restore fails, make vLLM forget the half-built model, so the checkpoint load can build it again:
    its layers registered in the forward context, and RoPE modules cached (keyed without the device) while
    they were still on the meta device."""
    from vllm.model_executor.layers.rotary_embedding import _ROPE_DICT

    cc = vllm_config.compilation_config
    layers, moe, ropes = dict(cc.static_forward_context), list(cc.static_all_moe_layers), set(_ROPE_DICT)
    try:
        yield
    except BaseException:
        cc.static_forward_context.clear()
        cc.static_forward_context.update(layers)
        cc.static_all_moe_layers[:] = moe
        for key in set(_ROPE_DICT) - ropes:
            del _ROPE_DICT[key]
        raise


def target_device(vllm_config, load_config) -> torch.device:
    device = vllm_config.device_config.device if load_config.device is None else load_config.device
    return torch.device(device)
