"""Engine side of a process checkpoint: pause for CRIU, resume after it.

A serving rank (``engine.pod.Pod``) with a snapshot store runs a
``DeviceHookServer``; the CRIU plugin's events arrive on its thread:

pause (before CRIU freezes the process)
    rank 0 queues the "suspend" control op, which every rank runs at the next
    step boundary: rank 0 closes its HTTP listener and client connections
    (requests in flight get 503 and are retried by their clients: no TCP
    socket can follow the process to a new pod), then every rank snapshots
    the state into the store (deduplicated: an unchanged engine writes
    nothing), tears the process groups down and drops its tensors.
    A follower's pause waits until rank 0's op has reached it, so the ranks
    of a group are checkpointed together. The answer names the device, rank
    and snapshot; a failure or a timeout is answered as an error and CRIU
    aborts the dump, leaving the engine running.
resume (after restore; after a --leave-running or failed dump)
    the rank, still inside the "suspend" op, re-reads where it is (the restore
    metadata: new IP, master, generation), maps its tensors back from the
    store, rejoins the group through comm_rebuild and returns to serving.
"""

from __future__ import annotations

import gc
import os
import queue
import socket
import threading
import time
from dataclasses import dataclass

from podsnap.comm_rebuild import groups
from podsnap.comm_rebuild.discovery import discover
from podsnap.engine.pod import log
from podsnap.engine.server import AdminOp
from podsnap.errors import PodsnapError
from podsnap.restore.loader import load_rank
from podsnap.snapshot.capture import snapshot_engine
from podsnap.snapshot.store import Store, new_snapshot_id

from .backends import backend_for, map_large_allocations
from .hooks import DeviceHookServer


def pause_timeout_s() -> float:
    """How long a pause may take: a little less than the plugin waits (PODSNAP_HOOK_TIMEOUT)."""
    return max(1.0, float(os.environ.get("PODSNAP_HOOK_TIMEOUT", "120")) - 5)


def open_inet_sockets() -> list[str]:
    """This process's IPv4/IPv6 sockets, as "fd N: local -> peer"."""
    out = []
    for fd in map(int, os.listdir("/proc/self/fd")):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            with socket.socket(fileno=os.dup(fd)) as sock:
                if sock.family in (socket.AF_INET, socket.AF_INET6):
                    try:
                        peer = sock.getpeername()
                    except OSError:
                        peer = "-"
                    out.append(f"fd {fd}: {sock.getsockname()} -> {peer}")
        except OSError:
            continue
    return out


def wait_for_inet_sockets_closed(timeout_s: float = 10.0) -> None:
    """No TCP socket may go into the image (none can follow the process to a new pod, and CRIU 4.1
    cannot dump one on kernels >= 6.16). The torn-down groups' store sockets close asynchronously:
    wait for them; any left past ``timeout_s`` fails the pause (the dump aborts, the engine resumes)."""
    deadline = time.monotonic() + timeout_s
    while left := open_inet_sockets():
        if time.monotonic() > deadline:
            raise PodsnapError(f"TCP sockets still open after the process groups were torn down: {'; '.join(left)}")
        gc.collect()
        time.sleep(0.05)


@dataclass
class Suspension:
    """One pause/resume cycle of this rank, as reported in logs and /health."""
    snapshot: str
    freed_bytes: int = 0
    paused_at: float = 0.0
    resumed_from: str | None = None  # the restore metadata the resume used
    resume_seconds: float = 0.0
    bytes_written: int | None = None  # rank 0: what the snapshot wrote to the store / found there already
    bytes_deduplicated: int | None = None


class ProcessCheckpointHooks:
    def __init__(self, pod, store_root: str, verify: str = "sample"):
        self.pod = pod
        self.store_root = store_root
        self.verify = verify
        self.backend = backend_for(pod.engine)
        map_large_allocations()
        self.paused = threading.Event()
        self.resuming = threading.Event()  # a resume was asked for and has not finished yet
        self.resumes: queue.Queue[str | None] = queue.Queue()
        self.current: Suspension | None = None
        self.history: list[Suspension] = []
        pod.engine.control_handlers["suspend"] = self.suspend
        self.hooks = DeviceHookServer(self.on_pause, self.on_resume)

    @property
    def rank(self) -> int:
        return self.pod.cfg.rank

    # --- hook thread ------------------------------------------------------------------

    def on_pause(self) -> str:
        self._wait_resumed()
        if not self.paused.is_set():
            op = None
            if self.rank == 0:
                op = self._start_suspend({"op": "suspend", "name": new_snapshot_id()})
            self._wait_paused(op)
        s = self.current
        stats = "" if s.bytes_written is None else f" written={s.bytes_written} deduplicated={s.bytes_deduplicated}"
        return f"{self.backend.name} rank={self.rank} snapshot={s.snapshot}{stats}"

    def _start_suspend(self, msg: dict) -> AdminOp:
        """Rank 0: a serving engine runs the op at its next step boundary; an engine without an HTTP
        server (a batch job, the benchmark) is idle between calls and runs it on a thread of its own."""
        if self.pod.server is not None:
            return self.pod.server.enqueue_admin(msg)
        op = AdminOp(msg)

        def run():
            try:
                op.result = self.pod.engine.collective(msg)
            except Exception as e:  # noqa: BLE001 - reported to the plugin as the pause's error
                op.error = f"{type(e).__name__}: {e}"
            op.done.set()

        threading.Thread(target=run, name="podsnap-suspend", daemon=True).start()
        return op

    def _wait_resumed(self) -> None:
        """A pause that arrives while the previous checkpoint's resume is still under way (a dump right
        after a --leave-running one) must wait for it: otherwise it would answer for the old pause and the
        engine would map its tensors back while CRIU dumps it."""
        deadline = time.monotonic() + pause_timeout_s()
        while self.resuming.is_set():
            if time.monotonic() > deadline:
                raise PodsnapError(f"rank {self.rank} is still resuming from the previous checkpoint after "
                                   f"{pause_timeout_s():g} s; try again when it serves")
            time.sleep(0.02)

    def _wait_paused(self, op) -> None:
        deadline = time.monotonic() + pause_timeout_s()
        while not self.paused.wait(0.1):
            if op is not None and op.done.is_set():
                raise PodsnapError(f"the suspend failed: {op.error or 'it ended without pausing'}")
            if time.monotonic() > deadline:
                who = "" if self.rank == 0 else " (a follower pauses when rank 0 is checkpointed with it)"
                raise PodsnapError(f"rank {self.rank} did not pause within {pause_timeout_s():g} s{who}")

    def on_resume(self, metadata: str | None) -> None:
        if self.paused.is_set() and not self.resuming.is_set():
            self.resuming.set()
            self.resumes.put(metadata)

    # --- main thread: the "suspend" control op, on every rank ------------------------------

    def suspend(self, engine, msg: dict) -> dict | None:
        if self.pod.server is not None:  # rank 0: TCP sockets cannot move to a new pod
            self.pod.server.stop_listening("the server is pausing for a process checkpoint; retry")
        done = snapshot_engine(engine, self.store_root, msg["name"])
        groups.teardown(timeout_s=10)
        s = self.current = Suspension(msg["name"], paused_at=time.time())
        if done is not None:  # rank 0: the whole group's capture statistics
            s.bytes_written, s.bytes_deduplicated = done[1].bytes_written, done[1].bytes_deduplicated
        s.freed_bytes = self.backend.release(engine)
        try:
            wait_for_inet_sockets_closed()
        except PodsnapError:
            self.resume(engine, None)  # serve on; the plugin reports the error and CRIU aborts the dump
            raise
        log(f"rank {self.rank}: paused for a process checkpoint (snapshot {s.snapshot}, "
                f"{s.freed_bytes / 2**20:.1f} MiB of tensors dropped)")
        self.paused.set()
        metadata = self.resumes.get()
        t = time.perf_counter()
        try:
            self.resume(engine, metadata)
        finally:
            self.paused.clear()
            self.resuming.clear()
        s.resumed_from, s.resume_seconds = metadata, time.perf_counter() - t
        self.history.append(s)
        if self.pod.server is not None:
            self.pod.publish_generation()
        log(f"rank {self.rank}: resumed in {s.resume_seconds:.3f} s (metadata {metadata or 'none'})")
        return None if done is None else {"snapshot": s.snapshot, "resume_seconds": round(s.resume_seconds, 6)}

    def resume(self, engine, metadata: str | None) -> None:
        """Map the tensors back and rejoin: where the metadata says (a restore in a new pod), else at
        the next generation of the same master (the process ran on after its dump)."""
        pod = self.pod
        store = Store(self.store_root, create=False)
        record = store.load(self.current.snapshot).ranks[engine.rank]
        tensors, _ = load_rank(store, record, verify=self.verify)
        self.backend.reacquire(engine, tensors)
        if metadata:
            pod.cfg.metadata = metadata
            pod.addrs = discover(self.rank, metadata)
            target = (pod.addrs.master_addr, pod.addrs.port_base, pod.addrs.generation)
        else:
            master = pod.addrs.own_addr if self.rank == 0 else pod.master[0]
            target = (master, pod.master[1], groups.registry.generation + 1)
        pod.join(*target, timeout_s=600)
        if pod.server is not None:
            pod.server.start_listening(pod.cfg.host)
        log(f"rank {self.rank}: rejoined generation {target[2]} at {target[0]}:{target[1]}")

    def close(self) -> None:
        self.hooks.close()
