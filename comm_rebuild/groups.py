"""The group registry: every process group is looked up by role at call time.

Roles are "world", "tp", "ep" and "dp". A rebuild destroys every group and
bumps ``generation``; code that looked groups up by role picks up the new
ones on its next call, and nothing holds a stale handle.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

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
