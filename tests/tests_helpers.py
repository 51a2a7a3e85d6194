"""Functions that spawned rank processes run in tests (they must be importable by name)."""

from __future__ import annotations


def join_and_sum(rank, world, base, generation):
    """Leave the launcher's group, form ``generation`` at ``base``, and all-reduce rank + 1."""
    import torch
    import torch.distributed as dist

    from podsnap.comm_rebuild import groups

    groups.teardown()
    groups.join("127.0.0.1", base, generation, rank, world, timeout_s=30)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item(), groups.registry.rendezvous.port
