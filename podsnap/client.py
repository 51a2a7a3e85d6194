"""A small HTTP client for `podsnap serve`, and a server process that can be started and stopped.

Used by the CLI (`snapshot create --server`), the demo and the tests, so all
three talk to a server, and stop it, the same way.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from podsnap.errors import PodsnapError


def request_json(url: str, body: dict | bytes | None = None, timeout: float = 600) -> tuple[int, dict]:
    """GET (no body) or POST JSON; returns (status, decoded reply), also for 4xx/5xx replies."""
    data = body if isinstance(body, bytes | None) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if "/admin/" in url and (token := os.environ.get("PODSNAP_ADMIN_TOKEN")):
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read())
        except ValueError:
            return e.code, {"error": {"message": e.reason}}
    except urllib.error.URLError as e:
        raise PodsnapError(f"cannot reach {url}: {e.reason}") from None


def completion(url: str, prompt: list[int], max_tokens: int) -> list[int]:
    status, body = request_json(f"{url}/v1/completions", {"prompt": prompt, "max_tokens": max_tokens,
                                                          "temperature": 0})
    if status != 200:
        raise PodsnapError(f"completion failed ({status}): {body.get('error', {}).get('message')}")
    return body["choices"][0]["token_ids"]


class ServerProcess:
    """`podsnap serve ARGS --port 0` in its own session; ``url`` once it serves.

    ``stop()`` sends SIGTERM to every process of the session by pid, then
    SIGKILL to whatever is left, so no rank outlives it.
    """

    def __init__(self, args: list[str], timeout_s: float = 600):
        t = time.perf_counter()
        self.proc = subprocess.Popen([sys.executable, "-m", "podsnap.cli", "serve", *args, "--port", "0"],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.log: list[str] = []
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                line = self.proc.stdout.readline()
                if not line and self.proc.poll() is not None:
                    raise PodsnapError("the server exited before serving:\n" + "".join(self.log[-20:]))
                self.log.append(line)
                if m := re.search(r"serving on (http://\S+) ", line):
                    self.url = m.group(1)
                    self.ready_seconds = time.perf_counter() - t
                    return
            raise PodsnapError(f"the server did not serve within {timeout_s:g} s")
        except BaseException:
            self.stop()
            raise

    def pids(self) -> list[int]:
        return [int(p) for p in subprocess.run(["pgrep", "-s", str(self.proc.pid)], capture_output=True,
                                               text=True).stdout.split()]

    def stop(self, grace_s: float = 10) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in self.pids():
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                continue
            if not self.pids():
                break

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
