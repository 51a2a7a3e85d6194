"""The snapshot agent's CheckpointContainer vs a direct CRIU dump of the same engine, side by side.

One engine process (TP=1, W8A8, no HTTP server; the engine of bench/criu.py)
keeps running while it is checkpointed ``--repeat`` times each way,
alternating:

- direct: ``criu_plugin.driver.dump(..., leave_running=True)``: the plugin
  pauses the engine (state into the store, tensors dropped), CRIU dumps, the
  engine resumes;
- agent:  a gRPC ``runtime.v1.RuntimeService/CheckpointContainer`` over the
  agent's Unix socket (standalone mode, the engine registered as a
  container): the same dump, plus finding the container, the per-container
  lock, the kubelet-layout archive (tar of the images, config.dump,
  spec.dump, podsnap.json, fsync, link into place) and removing the images.

Each checkpoint starts once the engine has resumed from the one before.
Printed: median seconds of each, the ratio agent/direct (what the agent adds
on top of CRIU), and the archive's size next to the CRIU image's.

    sudo python bench/agent.py --preset small      # or 1g
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from common import DEFAULT_WORKDIR, bench_model, print_rows
from criu import reap, wait_for

PR_SET_CHILD_SUBREAPER = 36


def start_engine(model: Path, store: Path, work: Path) -> subprocess.Popen:
    work.mkdir(parents=True)
    with open(work / "engine.log", "w") as log:
        return subprocess.Popen([sys.executable, str(Path(__file__).with_name("criu.py")), "--child", "podsnap",
                                 "--model", str(model), "--store", str(store), "--workdir", str(work)],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)


def direct_dump(pid: int, images: Path) -> tuple[float, int]:
    from podsnap.criu_plugin import driver

    t = time.perf_counter()
    result = driver.dump(pid, images, leave_running=True)
    seconds = time.perf_counter() - t
    shutil.rmtree(images)
    return seconds, result.image_bytes


def agent_checkpoint(client, container_id: str, location: Path) -> tuple[float, int]:
    t = time.perf_counter()
    client.checkpoint_container(container_id, str(location), timeout=300)
    seconds = time.perf_counter() - t
    size = location.stat().st_size
    with tarfile.open(location) as tar:
        big = sorted(((m.size, m.name) for m in tar.getmembers()), reverse=True)[:4]
    print("    largest archive members: " + ", ".join(f"{n} {b / 2**20:.1f} MiB" for b, n in big))
    location.unlink()
    return seconds, size


def wait_resumed(log: Path, count: int, timeout_s: float = 300) -> None:
    """Until the engine has resumed ``count`` times, so that no checkpoint is timed waiting for the last one's
    resume (a pause that arrives during a resume waits for it)."""
    deadline = time.monotonic() + timeout_s
    while log.read_text(errors="replace").count("resumed in") < count:
        if time.monotonic() > deadline:
            raise SystemExit(f"the engine did not resume; see {log}")
        time.sleep(0.02)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=["small", "1g"], default="small")
    ap.add_argument("--repeat", type=int, default=3, help="checkpoints each way (alternating)")
    ap.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR)
    args = ap.parse_args()
    if args.repeat < 1:
        ap.error(f"--repeat {args.repeat} must be at least 1")

    from podsnap.snapshot.agent import Agent, AgentConfig
    from podsnap.snapshot.client import AgentClient
    from podsnap.snapshot.registry import ContainerEntry, Registry

    model = bench_model("llama", args.preset, args.workdir)
    root = Path(f"/tmp/psb-{os.getpid()}")  # short: Unix socket paths have at most 107 bytes
    os.environ["PODSNAP_HOOK_DIR"] = str(root / "hooks")
    os.environ["PODSNAP_AGENT_REGISTRY"] = str(root / "registry")
    (root / "checkpoints").mkdir(parents=True, mode=0o700)
    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    proc = start_engine(model, root / "store", root / "engine")
    agent = None
    try:
        wait_for(root / "engine" / "before.json")
        entry = ContainerEntry.for_process("bench-engine", "bench", pid=proc.pid, store=str(root / "store"))
        Registry().register(entry)
        agent = Agent(AgentConfig(socket=root / "agent.sock", checkpoint_dir=root / "checkpoints",
                                  state_dir=root / "state")).start()
        client = AgentClient(root / "agent.sock")
        direct, via_agent = [], []
        for i in range(args.repeat):
            direct.append(direct_dump(proc.pid, root / f"images-{i}"))
            wait_resumed(root / "engine" / "engine.log", 2 * i + 1)
            via_agent.append(agent_checkpoint(client, "bench-engine", root / "checkpoints" / f"ckpt-{i}.tar"))
            wait_resumed(root / "engine" / "engine.log", 2 * i + 2)
            print(f"  run {i + 1}: direct {direct[-1][0]:.2f} s, agent {via_agent[-1][0]:.2f} s", flush=True)
        client.close()
    finally:
        if agent is not None:
            agent.stop()
        reap(proc.pid)
        shutil.rmtree(root, ignore_errors=True)

    d_s, a_s = statistics.median(s for s, _ in direct), statistics.median(s for s, _ in via_agent)
    image, archive = direct[-1][1], via_agent[-1][1]
    print_rows(f"checkpoint of a running engine (llama {args.preset}, W8A8, TP=1), medians of {args.repeat}",
               ["path", "seconds", "bytes"],
               [["direct CRIU dump (plugin)", f"{d_s:.2f}", f"{image / 2**20:.1f} MiB image"],
                ["agent CheckpointContainer", f"{a_s:.2f}", f"{archive / 2**20:.1f} MiB archive"]])
    print(f"\nagent / direct = {a_s / d_s:.2f}x time; archive / image = {archive / image:.3f}x bytes")


if __name__ == "__main__":
    main()
