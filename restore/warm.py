"""Warm start: a fresh engine process restores its state from the store.

The model is built on the meta device (no memory, no weights read), every
tensor of this rank is filled from the store by the loader, and the engine
starts serving. Neither the HF checkpoint is read nor post-processing run
(``platform.postprocess_calls`` stays 0). Before any byte is read, the
snapshot's fingerprint is compared with what this start asks for: the
model in ``--model`` (by tensor values), dtype, quantization, device layout,
parallel plan and code versions; a difference refuses the restore and names
the fields, unless ``force``.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from podsnap.engine.config import ModelConfig
from podsnap.engine.llm_engine import EngineOptions, LLMEngine, Timings
from podsnap.engine.model import CausalLM
from podsnap.engine.platform import get_platform
from podsnap.engine.sharding import ShardPlan
from podsnap.errors import PodsnapError
from podsnap.snapshot.fingerprint import cached_weights_hash, make_fingerprint
from podsnap.snapshot.manifest import Fingerprint, Manifest, RankRecord
from podsnap.snapshot.store import Store

from .loader import LoadStats, load_rank


class FingerprintMismatch(PodsnapError):
    def __init__(self, snapshot_id: str, snap: Fingerprint, requested: Fingerprint):
        self.fields = snap.differences(requested)
        super().__init__(f"snapshot {snapshot_id!r} does not match this start: {snap.describe(requested)}. "
                         "Restore refused; pass --force to restore anyway")


@dataclass
class RestoredFrom:
    snapshot_id: str
    weights: str
    load: LoadStats


def parse_restore_ref(ref: str) -> tuple[str, str]:
    """``STORE:SNAPSHOT`` -> (store path, snapshot id)."""
    store, sep, snap = ref.rpartition(":")
    if not sep or not store or not snap:
        raise PodsnapError(f"--restore {ref!r} is not STORE:SNAPSHOT (e.g. /mnt/snapshots:snap-20260101-...)")
    return store, snap


def requested_fingerprint(manifest: Manifest, store: Store, world: int, model_dir: str | Path | None,
                          options: EngineOptions | None) -> Fingerprint:
    """The fingerprint this start would have made, to compare with the snapshot's."""
    cfg = ModelConfig.load(model_dir) if model_dir else ModelConfig(**manifest.model_config)
    weights = cached_weights_hash(model_dir, store) if model_dir else manifest.fingerprint.weights
    opts = (options or EngineOptions(**manifest.options)).to_dict()
    plan = ShardPlan.build(cfg, world).to_dict(with_intervals=False)
    layout = get_platform(opts["platform"]).layout_tag
    return make_fingerprint(cfg, weights, opts, plan, layout)


def check_fingerprint(manifest: Manifest, requested: Fingerprint, force: bool) -> None:
    if not manifest.fingerprint.differences(requested):
        return
    mismatch = FingerprintMismatch(manifest.snapshot_id, manifest.fingerprint, requested)
    if not force:
        raise mismatch
    print(f"podsnap: warning: --force: {mismatch}", file=sys.stderr)


def restore_compile_cache(store: Store, rank: RankRecord) -> Path | None:
    """Unpack this rank's stored inductor cache into a fresh private directory (hash-checked)."""
    if not rank.compile_cache:
        return None
    from podsnap.engine.compile import private_cache_dir, unpack_cache

    digest = rank.compile_cache["blob"]
    problem = store.verify_blob(digest, rank.compile_cache["length"])
    if problem:
        raise PodsnapError(f"compile cache of rank {rank.rank}: {problem}")
    return unpack_cache(store.blob_path(digest).read_bytes(), private_cache_dir())


def warm_start(store_root: str | Path, snapshot_id: str, rank: int = 0, world_size: int = 1, *,
               model_dir: str | Path | None = None, options: EngineOptions | None = None, verify: str = "full",
               load_mode: str = "read", force: bool = False, progress=None) -> LLMEngine:
    timings = Timings()
    store = Store(store_root, create=False)
    manifest = store.load(snapshot_id)
    engine = manifest.extras.get("engine")
    if engine is not None:
        raise PodsnapError(f"snapshot {snapshot_id!r} holds a {engine} model's state; {engine} restores it itself "
                           "(for vLLM: load_format='podsnap' with this store), podsnap's own engine cannot run it")
    if world_size != manifest.world_size:
        raise PodsnapError(f"snapshot {snapshot_id!r} was taken on {manifest.world_size} rank(s); restoring it on "
                           f"{world_size} needs resharding, which this restore path does not do "
                           f"(use --tp {manifest.world_size})")
    check_fingerprint(manifest, requested_fingerprint(manifest, store, world_size, model_dir, options), force)
    cfg = ModelConfig(**manifest.model_config)
    options = EngineOptions(**manifest.options)
    platform = get_platform(options.platform)
    layout = ShardPlan.from_dict(manifest.plan).layouts[rank]
    with torch.device("meta"):
        model = CausalLM(cfg, layout)
    tensors, stats = load_rank(store, manifest.ranks[rank], verify, load_mode, progress=progress)
    kv = {n: tensors.pop(n) for n in [n for n in tensors if n.startswith("kv_cache.")]}
    model.load_state(tensors)
    derived_later = {r.name for r in manifest.ranks[rank].tensors if r.derive}
    for name, linear in model.named_modules():
        if f"{name}.qweight" in derived_later:
            linear.derive_on_first_use = platform.to_device_layout
    timings.load = time.perf_counter() - timings.started
    engine = LLMEngine(cfg, model, options, timings, platform, restore_compile_cache(store, manifest.ranks[rank]))
    if kv:
        engine.kv_cache.k.copy_(kv["kv_cache.k"])
        engine.kv_cache.v.copy_(kv["kv_cache.v"])
    engine.restored_from = RestoredFrom(snapshot_id, manifest.fingerprint.weights, stats)
    return engine
