"""Write a vLLM model's post-processed state into the store: one snapshot over all its ranks.

Every rank writes its own blobs (``podsnap.snapshot.capture.capture_rank``:
hashed, deduplicated, 0600), the per-rank records are gathered over the CPU
(gloo) group of the replica's ranks and rank 0 commits the manifest; the snapshot
is visible only then. A rank that fails tells the others instead of leaving
them waiting, and nothing is committed. Data-parallel replicas write the same
snapshot: blobs are content-addressed, and a replica that finds the manifest
committed by another with the same fingerprint is done. Records of tensors the engine no
longer holds readably (a CPU GEMM weight inside its oneDNN handle) can be
reused from an earlier snapshot: their blobs are already in the store.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from podsnap.errors import PodsnapError
from podsnap.snapshot.capture import CaptureStats, capture_rank
from podsnap.snapshot.manifest import Fingerprint, Manifest, RankRecord, TensorRecord
from podsnap.snapshot.store import Store, StoreError
from podsnap.state import EngineState

from .identity import ENGINE, Placement, model_identity


@dataclass(frozen=True)
class SnapshotRef:
    """The snapshot a worker's model state is in (restored from, or written at load): what suspend,
    resume and later snapshots build on."""

    store: Path
    snapshot_id: str
    rank: int
    world: int
    fingerprint: Fingerprint
    records: dict[str, TensorRecord] = field(default_factory=dict)  # this rank's, by tensor name


def gather(obj, where: Placement) -> list:
    """Every rank's ``obj``, in rank order, over the ranks of this model replica (no collective for one)."""
    if where.world == 1:
        return [obj]
    if where.group is None:
        raise PodsnapError("podsnap does not cover pipeline and data parallelism together (no process group "
                           "spans one replica's ranks)")
    import torch.distributed as dist

    out: list = [None] * where.world
    dist.all_gather_object(out, obj, group=where.group)
    return out


def manifest_for(snapshot_id: str, fingerprint: Fingerprint, ranks: list[RankRecord], vllm_config,
                 model_config, extras: dict) -> Manifest:
    pc = vllm_config.parallel_config
    options = {"dtype": fingerprint.dtype, "quantization": model_config.quantization,
               "kv_cache_dtype": vllm_config.cache_config.cache_dtype}
    plan = {"world_size": len(ranks), "tensor_parallel_size": pc.tensor_parallel_size,
            "pipeline_parallel_size": pc.pipeline_parallel_size}
    model = {"engine": ENGINE, "hf_config": model_identity(model_config.hf_config)}
    return Manifest(snapshot_id, time.time(), model, options, fingerprint, plan, sorted(ranks, key=lambda r: r.rank),
                    extras={"engine": ENGINE, **extras})


def write_snapshot(store: Store, snapshot_id: str, state: EngineState, where: Placement, fingerprint: Fingerprint,
                   vllm_config, model_config, extras: dict,
                   reuse: list[TensorRecord] = ()) -> tuple[RankRecord, CaptureStats]:
    """Collective over the ranks: write this rank's tensors, rank 0 commits. Returns this rank's record.

    A snapshot of the same name already committed (another replica of the same model got there
    first) counts as success when its fingerprint is the same.
    """
    with store.lock(exclusive=False):
        try:
            record, stats = capture_rank(store, state)
            mine: RankRecord | str = RankRecord(record.rank, [*record.tensors, *reuse])
        except (OSError, PodsnapError) as e:
            mine, stats = f"rank {state.rank}: {e}", CaptureStats()
        gathered = gather(mine, where)
        errors = [g for g in gathered if isinstance(g, str)]
        if errors:
            raise PodsnapError("snapshot failed, nothing was committed: " + "; ".join(errors))
        if state.rank == 0:
            manifest = manifest_for(snapshot_id, fingerprint, gathered, vllm_config, model_config, extras)
            try:
                store.commit(manifest)
            except StoreError:
                if snapshot_id not in store.list_ids() or store.load(snapshot_id).fingerprint.differences(fingerprint):
                    raise
    return mine, stats
