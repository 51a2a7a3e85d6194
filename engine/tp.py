"""Tensor-parallel collectives used by the engine, looked up by role per call.

With no tp group (a single rank) the reductions are the identity, so the
same model code runs on one rank and on many. ``broadcast_step`` is how rank
0, which schedules, tells the other ranks what to run next.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from podsnap.comm_rebuild.groups import registry

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def all_reduce(t: torch.Tensor, op: str = "sum", role: str = "tp") -> torch.Tensor:
    group = registry.get(role)
    if group is None or group.size == 1:
        return t
    t = t.contiguous()
    dist.all_reduce(t, op=_OPS[op], group=group.handle)
    return t


def broadcast_step(message: dict | None = None) -> dict:
    """Rank 0 sends ``message`` (a step, or a control op) to every rank; others receive it."""
    group = registry.get("world")
    box = [message]
    dist.broadcast_object_list(box, src=0, group=group.handle)
    return box[0]


def gather_to_leader(obj):
    """Every rank sends ``obj``; rank 0 gets the list by rank, the others get None."""
    group = registry.get("world")
    if group is None or group.size == 1:
        return [obj]
    out = [None] * group.size if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0, group=group.handle)
    return out
