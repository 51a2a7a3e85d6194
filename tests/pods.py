"""Serving ranks in pods for the multi-pod tests: a rank process, a retrying client stream,
and the TP=2 snapshot every rank warm-restores from.

A rank's output goes to a log file, not a pipe: a pipe to the test could not
follow the process through a CRIU checkpoint.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from procs import kill_tree

from podsnap.client import request_json
from podsnap.engine.generate import cold, generate
from podsnap.engine.launch import run_on_ranks
from podsnap.errors import PodsnapError
from podsnap.snapshot.capture import snapshot_on_rank

PROMPTS = [[(5 * i + j) % 250 + 1 for j in range(3 + i % 5)] for i in range(12)]
MAX_TOKENS = 10


def make_tp2_snapshot(model_dir: Path, store: Path) -> list[list[int]]:
    """Snapshot "s" of ``model_dir`` on 2 ranks into ``store``; returns the reference tokens of PROMPTS."""
    run_on_ranks(snapshot_on_rank, 2, cold(model_dir), str(store), "s")
    return generate(model_dir, PROMPTS, MAX_TOKENS).tokens


class Stream:
    """Clients sending every prompt, retrying (across endpoints) until each is answered."""

    def __init__(self, endpoints: list[str]):
        self.endpoints = endpoints  # the test may append the new master's URL
        self.answers: dict[int, list[int]] = {}
        self.pool = ThreadPoolExecutor(3)
        self.futures = [self.pool.submit(self._ask, i, p) for i, p in enumerate(PROMPTS)]

    def _ask(self, i, prompt, timeout_s=240):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for url in list(reversed(self.endpoints)):
                try:
                    status, body = request_json(f"{url}/v1/completions", {"prompt": prompt,
                                                                          "max_tokens": MAX_TOKENS}, timeout=60)
                except (PodsnapError, OSError):
                    continue
                if status == 200:
                    self.answers[i] = body["choices"][0]["token_ids"]
                    return
            time.sleep(0.2)
        raise AssertionError(f"request {i} was never answered")

    def wait_answered(self, n: int, timeout_s=60):
        deadline = time.monotonic() + timeout_s
        while len(self.answers) < n and time.monotonic() < deadline:
            time.sleep(0.05)

    def finish(self) -> list[list[int]]:
        for f in self.futures:
            f.result()
        self.pool.shutdown()
        return [self.answers[i] for i in range(len(PROMPTS))]


class LocalPod:
    """A "pod" on loopback, for scenarios that need no separate network: port 8000 becomes ``port``."""

    name, ip = "local", "127.0.0.1"

    def __init__(self, port: int):
        self.port = port

    def cmd(self, *args: str) -> list[str]:
        return [a if a != "8000" else str(self.port) for a in args]


class Rank:
    """``podsnap serve --rank R --world N`` inside ``pod``, warm-restoring from ``store:s`` (or, with
    ``store=None``, starting as ``args`` say)."""

    def __init__(self, pod, rank, store, *args, world: int = 2, log_dir: Path | None = None, pass_fds=()):
        self.pod = pod
        log_dir = log_dir or Path(tempfile.gettempdir())
        self.log = log_dir / f"rank{rank}-{pod.name}-{os.urandom(3).hex()}.log"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                pod.cmd(sys.executable, "-m", "podsnap.cli", "serve", "--rank", str(rank), "--world", str(world),
                        *(["--restore", f"{store}:s"] if store else []), "--host", "0.0.0.0", "--port", "8000",
                        "--connect-timeout", "120", *args),
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                pass_fds=pass_fds)
        self.pid = self.proc.pid

    @property
    def lines(self) -> list[str]:
        return self.log.read_text(errors="replace").splitlines(keepends=True)

    def wait_for(self, text: str, timeout_s=120) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(text in x for x in self.lines):
                return
            time.sleep(0.1)
        raise AssertionError(f"{text!r} not in the log of the rank in pod {self.pod.name}:\n"
                             + "".join(self.lines[-30:]))

    def wait_serving(self, timeout_s=120) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any("serving on" in x for x in self.lines):
                return f"http://{self.pod.ip}:8000"
            assert self.proc.poll() is None, "".join(self.lines[-30:])
            time.sleep(0.1)
        raise AssertionError("rank 0 did not serve:\n" + "".join(self.lines[-30:]))

    def crash(self):
        """The pod dies without warning (SIGKILL)."""
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def kill(self):
        kill_tree(self.proc.pid)
        self.proc.wait()


def health(url) -> dict:
    return request_json(f"{url}/health", timeout=10)[1]
