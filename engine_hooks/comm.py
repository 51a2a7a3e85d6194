"""Rebuild a vLLM worker's process groups for new pod addresses, with comm_rebuild's discovery and ports.

vLLM keeps its groups in ``vllm.distributed.parallel_state`` (world, tp, pp,
dp, ep, ...). A rebuild:

1. tears them down with vLLM's own destroy functions (after the platform
   entry's ``before_teardown``: groups a platform plugin adds, e.g. Ascend MC2);
2. forms generation *g* of the default process group through
   ``comm_rebuild.groups.join``: rank 0 hosts the rendezvous on the first free
   port of ``base + g + 97·i``, the others find it there; gloo is pinned to
   the interface holding the pod's address;
3. lets vLLM build its groups on top: ``init_worker_distributed_environment``
   finds the default group initialized and only creates its coordinators;
4. runs the entry's ``after_rebuild`` hooks (handles that modules keep, e.g.
   vllm-ascend's MoE ``tp_group/dp_group/ep_group/mc2_group``).

Addresses come from ``comm_rebuild.discovery``: the restore-metadata file
(``{"generation", "master_addr", "port_base", "rank_map"}``), the environment,
the interfaces. Verified here with vLLM on CPU at TP=1 (a group of one, gloo);
multi-rank vLLM groups (gloo, NCCL, HCCL) are not run on these machines.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from podsnap.comm_rebuild import groups
from podsnap.comm_rebuild.discovery import Addresses, discover

from .derived_state import PlatformEntry


@dataclass(frozen=True)
class RebuildResult:
    generation: int
    master_addr: str
    port: int  # where generation's rendezvous met
    own_addr: str
    sources: dict[str, str]
    teardown_s: float
    join_s: float
    vllm_groups_s: float

    def to_dict(self) -> dict:
        return asdict(self)


def addresses(rank: int, metadata: str | Path | dict) -> Addresses:
    """``metadata``: the restore-metadata file, or its content as a dict (parsed by the same reader)."""
    if not isinstance(metadata, dict):
        return discover(rank, metadata_path=metadata)
    fd, path = tempfile.mkstemp(prefix="podsnap-restore-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(metadata, f)
        return discover(rank, metadata_path=path)
    finally:
        os.unlink(path)


def teardown_vllm(entry: PlatformEntry) -> None:
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    for hook in entry.before_teardown:
        hook()
    destroy_model_parallel()
    destroy_distributed_environment()
    groups.teardown()  # nothing left to destroy; forgets the previous generation's rendezvous


def rebuild(worker, model, entry: PlatformEntry, metadata: str | Path | dict, timeout_s: float = 60.0) -> RebuildResult:
    from vllm.config import set_current_vllm_config
    from vllm.platforms import current_platform
    from vllm.v1.worker.gpu_worker import init_worker_distributed_environment

    cfg = worker.vllm_config
    world = cfg.parallel_config.world_size
    addrs = addresses(worker.rank, metadata)
    t0 = time.perf_counter()
    teardown_vllm(entry)
    t1 = time.perf_counter()
    groups.join(addrs.master_addr, addrs.port_base, addrs.generation, worker.rank, world,
                current_platform.dist_backend, timeout_s, own_addr=addrs.own_addr, single=True)
    t2 = time.perf_counter()
    with set_current_vllm_config(cfg):
        init_worker_distributed_environment(cfg, worker.rank, None, worker.local_rank, current_platform.dist_backend)
        for hook in entry.after_rebuild:
            hook(model, cfg)
    t3 = time.perf_counter()
    return RebuildResult(addrs.generation, addrs.master_addr, groups.registry.rendezvous.port, addrs.own_addr,
                         addrs.sources, t1 - t0, t2 - t1, t3 - t2)
