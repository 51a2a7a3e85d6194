"""State capture: write a running engine's state into the store as a snapshot.

Every rank calls ``snapshot_engine`` at the same step boundary. Each rank
hashes and writes its own tensors in parallel (a thread pool; BLAKE3 and
file writes release the GIL); a tensor whose blob already exists is not
written again. Rank 0 gathers the per-rank records, builds the manifest with
the fingerprint and commits it: the snapshot becomes visible only then.

``portable`` stores device-layout tensors (FRACTAL_NZ weights) in plain ND
form with a ``derive`` flag, so a restore on another device type converts
them on first use ("on-demand derivation").
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from podsnap.engine import nz, tp
from podsnap.engine.llm_engine import LLMEngine
from podsnap.engine.sharding import ShardPlan
from podsnap.errors import PodsnapError
from podsnap.state import EngineState, StateTensor

from .fingerprint import cached_weights_hash, make_fingerprint
from .manifest import Manifest, RankRecord, TensorRecord
from .store import Store, check_snapshot_id, new_snapshot_id


@dataclass
class CaptureStats:
    tensors: int = 0
    bytes_total: int = 0
    bytes_written: int = 0
    blobs_written: int = 0
    seconds: float = 0.0

    @property
    def bytes_deduplicated(self) -> int:
        return self.bytes_total - self.bytes_written

    def add(self, other: CaptureStats) -> CaptureStats:
        return CaptureStats(self.tensors + other.tensors, self.bytes_total + other.bytes_total,
                            self.bytes_written + other.bytes_written, self.blobs_written + other.blobs_written,
                            max(self.seconds, other.seconds))

    def to_dict(self) -> dict:
        return {"tensors": self.tensors, "bytes_total": self.bytes_total, "bytes_written": self.bytes_written,
                "bytes_deduplicated": self.bytes_deduplicated, "blobs_written": self.blobs_written,
                "seconds": round(self.seconds, 6)}


def tensor_bytes(t: torch.Tensor):
    """A zero-copy byte view of a CPU tensor (a contiguous copy first if needed)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


def stored_form(st: StateTensor, portable: bool) -> tuple[torch.Tensor, str, str | None]:
    """(tensor to store, its layout tag, layout to derive on restore)."""
    if portable and st.meta.layout == "nz":
        m, n = st.meta.nd_shape
        return nz.nz_to_nd(st.tensor, m, n), "nd", "nz"
    return st.tensor, st.meta.layout, None


def capture_rank(store: Store, state: EngineState, portable: bool = False, workers: int = 4,
                 progress: Callable[[int], None] | None = None,
                 compile_cache: Path | None = None) -> tuple[RankRecord, CaptureStats]:
    t0 = time.perf_counter()

    def one(st: StateTensor) -> tuple[TensorRecord, bool]:
        tensor, layout, derive = stored_form(st, portable)
        data = tensor_bytes(tensor)
        digest, written = store.put_blob(data)
        if progress:
            progress(data.nbytes)
        interval = st.meta.interval.to_dict() if st.meta.interval else None
        return TensorRecord(st.name, st.meta.role.value, str(tensor.dtype).removeprefix("torch."),
                            list(tensor.shape), layout, interval, digest, 0, data.nbytes, derive), written

    with ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(one, state.tensors))
    records = [r for r, _ in results]
    stats = CaptureStats(len(records), sum(r.length for r in records),
                         sum(r.length for r, w in results if w), sum(w for _, w in results),
                         time.perf_counter() - t0)
    return RankRecord(state.rank, records, capture_compile_cache(store, compile_cache)), stats


def capture_compile_cache(store: Store, cache_dir: Path | None) -> dict | None:
    """Store this rank's inductor cache directory as one blob (see engine/compile.py)."""
    if cache_dir is None:
        return None
    from podsnap.engine.compile import pack_cache

    data = pack_cache(cache_dir)
    digest, _ = store.put_blob(data)
    return {"blob": digest, "length": len(data)}


def snapshot_engine(engine: LLMEngine, store_root: str | Path, snapshot_id: str | None = None,
                    with_kv: bool = False, portable: bool = False,
                    progress: Callable[[int], None] | None = None) -> tuple[Manifest, CaptureStats] | None:
    """Collective: every rank captures its state; rank 0 commits and returns (manifest, stats)."""
    snapshot_id = check_snapshot_id(snapshot_id) if snapshot_id else None
    store = Store(store_root)
    with store.lock(exclusive=False):  # gc/rm wait until the snapshot is committed
        try:
            mine = capture_rank(store, engine.state(with_kv), portable, progress=progress,
                                compile_cache=engine.compile_cache_dir)
        except (OSError, PodsnapError) as e:  # tell rank 0 instead of leaving it waiting
            mine = f"rank {engine.rank}: {e}"
        gathered = tp.gather_to_leader(mine)
        if engine.rank != 0:
            return None
        errors = [g for g in gathered if isinstance(g, str)]
        if errors:
            raise PodsnapError("snapshot failed, nothing was committed: " + "; ".join(errors))
        records = [g[0] for g in gathered]
        stats = gathered[0][1]
        for _, s in gathered[1:]:
            stats = stats.add(s)
        manifest = build_manifest(engine, store, snapshot_id or new_snapshot_id(), records, with_kv)
        store.commit(manifest)
    return manifest, stats


def build_manifest(engine: LLMEngine, store: Store, snapshot_id: str, records: list[RankRecord],
                   with_kv: bool) -> Manifest:
    plan = ShardPlan.build(engine.cfg, engine.world_size).to_dict()
    options = engine.options.to_dict()
    if engine.model_dir is not None:
        weights, source = cached_weights_hash(engine.model_dir, store), str(engine.model_dir.resolve())
    else:  # a restored engine: its identity is the snapshot it came from
        weights, source = engine.restored_from.weights, f"snapshot {engine.restored_from.snapshot_id}"
    fingerprint = make_fingerprint(engine.cfg, weights, options, plan, engine.platform.layout_tag)
    extras = {"source": source}
    if with_kv:
        extras["kv"] = {"block_size": engine.kv_cache.block_size, "num_blocks": engine.kv_cache.num_blocks}
    return Manifest(snapshot_id, time.time(), engine.cfg.to_dict(), options, fingerprint, plan, records,
                    with_kv, extras)


def summary(done: tuple[Manifest, CaptureStats] | None) -> dict | None:
    """What rank 0 reports about a committed snapshot (None on the other ranks)."""
    if done is None:
        return None
    manifest, stats = done
    return {"snapshot": manifest.snapshot_id, **stats.to_dict()}


def snapshot_on_rank(rank: int, world: int, start, store_root: str, name: str | None, with_kv: bool = False,
                     portable: bool = False, progress: Callable[[int], None] | None = None) -> dict | None:
    """Start the engine of ``rank`` (``start(rank, world)``), warm it up if it compiles, snapshot it.

    Collective over the ranks; rank 0 returns the summary with the start's timings.
    """
    from podsnap.engine.generate import warm_up

    engine = start(rank, world)
    warm_up(engine)
    done = summary(snapshot_engine(engine, store_root, name, with_kv, portable, progress))
    return None if done is None else {**done, "cold_start": engine.timings.to_dict()}


def snapshot_handler(store_root: str | Path):
    """The "snapshot" control op of a serving engine; every rank writes to its own ``store_root``."""

    def handle(engine: LLMEngine, msg: dict) -> dict | None:
        done = summary(snapshot_engine(engine, store_root, msg["name"], msg.get("with_kv", False),
                                       msg.get("portable", False)))
        return None if done is None else {**done, "store": str(store_root)}

    return handle
