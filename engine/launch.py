"""Starting one process per rank on this machine and collecting rank 0's result.

``run_on_ranks(target, world, *args)`` spawns ``world`` processes; each forms
the process group (``comm_rebuild``), calls ``target(rank, world, *args)``
and rank 0's return value comes back. A failure on any rank is raised here
with that rank's message. Every process is stopped by pid before returning,
also on error or interrupt.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import time
import traceback

import torch

from podsnap.comm_rebuild.groups import destroy_world, init_world
from podsnap.errors import PodsnapError


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def threads_per_rank(world: int) -> int:
    return max(1, (os.cpu_count() or 1) // world)


def _rank_main(target, rank: int, world: int, master: str, backend: str, results, args) -> None:
    try:
        torch.set_num_threads(threads_per_rank(world))
        init_world(master, rank, world, backend)
        value = target(rank, world, *args)
        if rank == 0:  # by value: torch would pass tensors as shared-memory fds, which die with this process
            results.put(("ok", rank, pickle.dumps(value)))
    except BaseException as e:  # report every failure to the parent, then exit non-zero
        detail = str(e) if isinstance(e, PodsnapError) else traceback.format_exc(limit=5)
        results.put(("error", rank, detail))
        raise SystemExit(1) from None
    finally:
        destroy_world()


def _alive(p) -> bool:
    return p.poll() is None if isinstance(p, subprocess.Popen) else p.is_alive()


def _reap(p, timeout_s: float | None) -> None:
    if isinstance(p, subprocess.Popen):
        try:
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
    else:
        p.join(timeout_s)


def stop_processes(procs, grace_s: float = 5.0) -> None:
    """Terminate, then kill, every process still alive (multiprocessing or subprocess), and reap it."""
    for p in procs:
        if _alive(p):
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        _reap(p, max(0.0, deadline - time.monotonic()))
        if _alive(p):
            p.kill()
            _reap(p, None)


def run_on_ranks(target, world: int, *args, backend: str = "gloo", timeout_s: float = 600.0):
    """Run ``target(rank, world, *args)`` on ``world`` new processes; return rank 0's value."""
    if world < 1:
        raise PodsnapError(f"--tp {world}: the number of ranks must be at least 1")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    master = f"127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_rank_main, args=(target, r, world, master, backend, results, args),
                         name=f"podsnap-rank{r}", daemon=True) for r in range(world)]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                status, rank, value = results.get(timeout=0.2)
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise PodsnapError(f"{dead[0].name} exited with status {dead[0].exitcode} "
                                       "without reporting an error") from None
                continue
            if status == "error":
                raise PodsnapError(f"rank {rank} failed: {value}")
            return pickle.loads(value)
        raise PodsnapError(f"ranks did not finish within {timeout_s:g} s")
    finally:
        stop_processes(procs)


def launch_local_pods(world: int, rank_args: list[str]) -> list:
    """Run ``world`` `podsnap serve --rank R` processes (one per pod) on this machine.

    Blocks until one exits or SIGTERM arrives, then stops the others by pid
    (a local group is started and stopped as a whole); returns the processes.
    """
    master = f"127.0.0.1:{free_port()}"
    procs = []
    try:
        for rank in range(world):
            cmd = [sys.executable, "-m", "podsnap.cli", "serve", "--rank", str(rank), "--world", str(world),
                   "--master", master, *rank_args]
            procs.append(subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": str(threads_per_rank(world))}))
        stop = []
        signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
        while not stop and all(p.poll() is None for p in procs):
            time.sleep(0.2)
        return procs
    finally:
        stop_processes(procs, grace_s=10)
