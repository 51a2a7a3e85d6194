"""One rendezvous per generation, on a port chosen by the incremental port policy.

Generation ``g`` of a group meets at a TCPStore hosted by its rank 0 on the
first free port of ``candidate_ports(base, g)``: ``base + g``, then
``base + g + 97``, ``base + g + 194``, ... The master probes by binding (a
port held by anyone else, a TIME_WAIT socket or another program, is
skipped). Joiners scan the same candidates and accept only a store whose
``podsnap/generation`` key says ``g``: the store itself is where all ranks
agree on the port. A fresh generation never reuses the previous one's port,
so a half-closed old store cannot be mistaken for the new one.

Deferred join: a rank marks itself ready in the store only after it has
warmed up (restored its state); rank 0 polls the ready keys without
blocking, between its own work, and the group is formed when all are there.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from podsnap.errors import PodsnapError

PORT_STEP = 97
PORT_TRIES = 8
GEN_KEY = "podsnap/generation"


def candidate_ports(base: int, generation: int, tries: int = PORT_TRIES) -> list[int]:
    ports = [base + generation + i * PORT_STEP for i in range(tries)]
    return [p for p in ports if 0 < p < 65536]


@dataclass
class Rendezvous:
    store: dist.TCPStore
    addr: str
    port: int
    generation: int
    world_size: int
    ready: list[bool] = field(default_factory=list)  # the active mask of the forming generation

    def mark_ready(self, rank: int) -> None:
        self.store.set(f"podsnap/ready/{rank}", "1")

    def poll_ready(self) -> list[bool]:
        """Non-blocking: which ranks have marked themselves ready."""
        self.ready = [self.store.check([f"podsnap/ready/{r}"]) for r in range(self.world_size)]
        return self.ready

    def wait_all_ready(self, timeout_s: float, between=None) -> None:
        """Rank 0: wait for every rank, calling ``between()`` while waiting (e.g. to keep taking requests)."""
        deadline = time.monotonic() + timeout_s
        while not all(self.poll_ready()):
            if time.monotonic() > deadline:
                missing = [r for r, ok in enumerate(self.ready) if not ok]
                raise PodsnapError(f"generation {self.generation}: rank(s) {missing} did not join within "
                                   f"{timeout_s:g} s at {self.addr}:{self.port}")
            if between:
                between()
            else:
                time.sleep(0.02)


def host(addr: str, base: int, generation: int, world: int, timeout_s: float) -> Rendezvous:
    """Rank 0: bind the first free candidate port on ``addr`` and publish the generation there."""
    tried = []
    for port in candidate_ports(base, generation):
        try:
            store = dist.TCPStore(addr, port, world_size=None, is_master=True, wait_for_workers=False,
                                  timeout=timedelta(seconds=timeout_s))
        except (RuntimeError, dist.DistError) as e:
            tried.append(f"{port} ({str(e).splitlines()[0][:60]})")
            continue
        store.set(GEN_KEY, str(generation))
        return Rendezvous(store, addr, port, generation, world, [False] * world)
    raise PodsnapError(f"generation {generation}: no free rendezvous port on {addr}; tried {', '.join(tried)}")


def _accepts(addr: str, port: int) -> bool:
    try:
        with socket.create_connection((addr, port), timeout=0.5):
            return True
    except OSError:
        return False


STUCK = "stuck"


def _connect(addr: str, port: int, timeout_s: float):
    """A TCPStore client; None if it failed (retry later); STUCK if the port does not answer as one.

    The client's handshake ignores its timeout when the port belongs to some
    other program, so it runs on a daemon thread (the call releases the GIL)
    that is abandoned, not waited for, past twice the timeout.
    """
    box: list = []

    def run():
        try:
            box.append(dist.TCPStore(addr, port, world_size=None, is_master=False,
                                     timeout=timedelta(seconds=timeout_s)))
        except (RuntimeError, dist.DistError) as e:
            box.append(e)

    thread = threading.Thread(target=run, daemon=True, name=f"rendezvous-probe-{port}")
    thread.start()
    thread.join(2 * timeout_s)
    if not box:
        return STUCK
    return box[0] if isinstance(box[0], dist.TCPStore) else None


def find(addr: str, base: int, generation: int, world: int, timeout_s: float) -> Rendezvous:
    """Other ranks: find generation ``generation``'s store among the candidate ports of ``addr``."""
    deadline = time.monotonic() + timeout_s
    ports = candidate_ports(base, generation)
    foreign: set[int] = set()  # ports held by something that is not a TCPStore: not asked twice
    while True:
        for port in ports:
            if port in foreign or not _accepts(addr, port):
                continue
            store = _connect(addr, port, min(5.0, timeout_s))
            if store is STUCK:
                foreign.add(port)
            if store is None or store is STUCK:
                continue
            try:
                if store.get(GEN_KEY).decode() == str(generation):
                    store.set_timeout(timedelta(seconds=timeout_s))
                    return Rendezvous(store, addr, port, generation, world)
            except (RuntimeError, dist.DistError, ValueError):
                continue  # another generation's store, or one without our key
        if time.monotonic() > deadline:
            raise PodsnapError(f"could not find the rendezvous of generation {generation} at {addr} "
                               f"(ports {ports[0]}..{ports[-1]}) within {timeout_s:g} s")
        time.sleep(0.02)
