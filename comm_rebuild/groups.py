"""The group registry: every process group is looked up by role at call time.

Roles are "world", "tp", "ep" and "dp". A rebuild destroys every group and
bumps ``generation``; code that looked groups up by role picks up the new
ones on its next call, and nothing holds a stale handle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from podsnap.errors import PodsnapError

ROLES = ("world", "tp", "ep", "dp")


@dataclass
class Group:
    role: str
    ranks: list[int]
    handle: object | None  # a torch ProcessGroup; None for a single-rank group

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass
class GroupRegistry:
    generation: int = 0
    groups: dict[str, Group] = field(default_factory=dict)

    def register(self, role: str, ranks: list[int], handle: object | None) -> Group:
        if role not in ROLES:
            raise ValueError(f"unknown group role {role!r}; roles: {', '.join(ROLES)}")
        group = Group(role, list(ranks), handle)
        self.groups[role] = group
        return group

    def get(self, role: str) -> Group | None:
        return self.groups.get(role)

    def size(self, role: str) -> int:
        group = self.groups.get(role)
        return group.size if group else 1

    def clear(self) -> None:
        """Forget every group (after the backend has been torn down)."""
        self.groups.clear()
        self.generation += 1


registry = GroupRegistry()


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def parse_master(master: str) -> tuple[str, int]:
    """``"HOST:PORT"`` -> (host, port), with an error naming the bad value."""
    host, sep, port = master.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise PodsnapError(f"--master {master!r} is not HOST:PORT (e.g. 10.0.0.5:29500)")
    return host.strip("[]"), int(port)


def init_world(master: str, rank: int, world: int, backend: str = "gloo", timeout_s: float = 60.0) -> None:
    """Join the process group of ``world`` ranks at ``master`` and register world/tp/ep.

    Fails with a clear error (not a hang) when the master cannot be reached
    within ``timeout_s``.
    """
    host, port = parse_master(master)
    if world == 1:
        return
    try:
        dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, dist.DistError) as e:
        raise PodsnapError(f"rank {rank} of {world} could not form the process group at {host}:{port} within "
                           f"{timeout_s:g} s ({str(e).splitlines()[0]}); check --master and that rank 0 "
                           "is running and reachable") from None
    ranks = list(range(world))
    for role in ("world", "tp", "ep"):
        registry.register(role, ranks, dist.group.WORLD)


def destroy_world() -> None:
    """Tear down every group (idempotent)."""
    if is_distributed():
        dist.destroy_process_group()
    registry.clear()
