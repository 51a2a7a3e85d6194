"""Tensor-parallel collectives used by the model, looked up by role per call.

With no tp group (a single rank) every function is the identity, so the
same model code runs on one rank and on many.
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
