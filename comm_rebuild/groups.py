"""The group registry: every process group is looked up by role at call time.

Roles are "world", "tp", "ep" and "dp". ``join`` forms the groups of one
generation through its rendezvous (``rendezvous.py``); ``teardown`` destroys
them with a bound on the time it may take, also when a peer is dead. Code
that looks groups up by role picks up the new ones on its next call, so no
module holds a stale handle across a rebuild.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from podsnap.errors import PodsnapError

from . import rendezvous
from .discovery import interface_for

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
    rendezvous: rendezvous.Rendezvous | None = None  # keeps this generation's store (and rank 0's server) alive

    def register(self, role: str, ranks: list[int], handle: object | None) -> Group:
        if role not in ROLES:
            raise ValueError(f"unknown group role {role!r}; roles: {', '.join(ROLES)}")
        group = Group(role, list(ranks), handle)
        self.groups[role] = group
        return group

    def get(self, role: str) -> Group | None:
        return self.groups.get(role)

    def clear(self) -> None:
        """Forget every group (after the backend has been torn down)."""
        self.groups.clear()
        self.rendezvous = None


registry = GroupRegistry()


@dataclass
class JoinTimings:
    rendezvous: float = 0.0  # find or host the store, wait for every rank to be ready
    groups: float = 0.0  # create the process groups

    def to_dict(self) -> dict:
        return {"rendezvous": round(self.rendezvous, 6), "groups": round(self.groups, 6)}


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def parse_master(master: str) -> tuple[str, int]:
    """``"HOST:PORT"`` -> (host, port), with an error naming the bad value."""
    host, sep, port = master.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise PodsnapError(f"--master {master!r} is not HOST:PORT (e.g. 10.0.0.5:29500)")
    return host.strip("[]"), int(port)


def join(master_addr: str, port_base: int, generation: int, rank: int, world: int, backend: str = "gloo",
         timeout_s: float = 60.0, own_addr: str | None = None, between=None, single: bool = False) -> JoinTimings:
    """Form generation ``generation``'s groups: rank 0 hosts the rendezvous, the others find it.

    ``between`` is called by rank 0 while it waits for the others (to keep
    taking requests). ``own_addr`` pins gloo to the interface holding it.
    A world of one forms no group unless ``single`` (an engine that always
    runs inside a process group, such as vLLM).
    """
    timings = JoinTimings()
    if world == 1 and not single:
        registry.generation = generation
        return timings
    t = time.perf_counter()
    try:
        if rank == 0:
            rdzv = rendezvous.host(master_addr, port_base, generation, world, timeout_s)
            rdzv.mark_ready(0)
            rdzv.wait_all_ready(timeout_s, between)
        else:
            rdzv = rendezvous.find(master_addr, port_base, generation, world, timeout_s)
            rdzv.mark_ready(rank)
    except PodsnapError as e:
        raise PodsnapError(f"rank {rank} of {world} could not form the process group at {master_addr}:{port_base} "
                           f"within {timeout_s:g} s ({e}); check --master and that rank 0 is running and "
                           "reachable") from None
    timings.rendezvous = time.perf_counter() - t
    t = time.perf_counter()
    if own_addr and (ifname := interface_for(own_addr)):
        os.environ["GLOO_SOCKET_IFNAME"] = ifname
    dist.init_process_group(backend, store=dist.PrefixStore(f"podsnap/g{generation}/", rdzv.store), rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout_s))
    ranks = list(range(world))
    for role in ("world", "tp", "ep"):
        registry.register(role, ranks, dist.group.WORLD)
    registry.rendezvous = rdzv
    registry.generation = generation
    timings.groups = time.perf_counter() - t
    return timings


def init_world(master: str, rank: int, world: int, backend: str = "gloo", timeout_s: float = 60.0) -> None:
    """Generation 0 of a group whose rank 0 is at ``master`` (HOST:PORT)."""
    host, port = parse_master(master)
    join(host, port, 0, rank, world, backend, timeout_s)


def teardown(timeout_s: float = 10.0) -> float:
    """Destroy every group, waiting at most ``timeout_s``; returns the seconds it took.

    Destroying a gloo group is local, but a backend may block on a dead peer,
    so it runs on a helper thread; past the bound the old groups are
    abandoned (reported on stderr) and the registry is cleared anyway.
    """
    t = time.perf_counter()
    if is_distributed():
        done = threading.Thread(target=dist.destroy_process_group, daemon=True, name="teardown")
        done.start()
        done.join(timeout_s)
        if done.is_alive():
            print(f"podsnap: teardown of generation {registry.generation} did not finish in {timeout_s:g} s; "
                  "abandoning the old groups", file=sys.stderr)
    registry.clear()
    return time.perf_counter() - t


def destroy_world() -> None:
    """Tear down every group (idempotent)."""
    teardown()
