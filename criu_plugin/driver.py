"""Run CRIU on an engine process: dump it through podsnap's plugin, restore it into a pod.

``dump`` runs ``criu dump`` in the process's own network namespace (so CRIU
treats that namespace as external and leaves it out) with what an engine pod
needs: ``--tcp-close`` (no TCP connection is carried to a new pod),
``--ext-unix-sk``, ``--file-locks``, ``--link-remap`` and ``-L`` with the
plugin directory; ``--shell-job`` when the process does not lead its own
session. A podsnap engine closes its own TCP sockets when the plugin pauses
it (gloo groups, HTTP listener and clients): besides, CRIU 4.1 cannot dump an
inet socket on this kernel (6.18: ``getsockopt(SO_PASSCRED)`` is refused). ``restore`` runs ``criu restore``
inside the target network namespace (``nsenter --net``: ``ip netns exec``
would add a mount namespace). On failure the error quotes the first error
line of CRIU's log and names the log file.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from podsnap.errors import PodsnapError
from podsnap.snapshot.store import mkdir_private, write_atomic

from . import tools

PROCESS_INFO = "podsnap-process.json"
NETNS_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
# Error lines CRIU prints without failing (it cannot raise its own RLIMIT_NOFILE in a container).
BENIGN_ERRORS = ("Can't setup RLIMIT_NOFILE",)


class CriuError(PodsnapError):
    def __init__(self, action: str, log: Path, line: str | None, returncode: int | None, timed_out: bool = False):
        self.action, self.log, self.line, self.timed_out = action, log, line, timed_out
        why = f": {line}" if line else f" (exit status {returncode}; no error line in the log)"
        super().__init__(f"criu {action} failed{why} [log: {log}]")


@dataclass
class ProcessInfo:
    """What a restore needs to know about the dumped process (stored with its images)."""
    pid: int
    shell_job: bool
    engine: dict = field(default_factory=dict)  # the plugin's pause answer: device, rank, snapshot
    dumped_at: float = 0.0

    def write(self, images: Path) -> None:
        write_atomic(images / PROCESS_INFO, json.dumps(asdict(self)).encode())

    @classmethod
    def read(cls, images: Path) -> ProcessInfo:
        try:
            return cls(**json.loads((images / PROCESS_INFO).read_text()))
        except (OSError, ValueError, TypeError) as e:
            raise PodsnapError(f"{images} holds no podsnap process checkpoint ({e})") from None


@dataclass
class DumpResult:
    pid: int
    images: Path
    seconds: float
    image_bytes: int
    engine: dict  # empty when the process was not a podsnap engine (no plugin answer)
    left_running: bool

    def to_dict(self) -> dict:
        return {**asdict(self), "images": str(self.images)}


def first_error(log: Path) -> str | None:
    """The first error line of a CRIU log, without its timestamp."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in lines:
        text = re.sub(r"^\(\s*[\d.]+\)\s*", "", line)
        if text.startswith("Error") and not any(b in text for b in BENIGN_ERRORS):
            return text
    return None


def image_bytes(images: Path) -> int:
    return sum(p.stat().st_size for p in images.iterdir() if p.suffix == ".img")


def engine_answer(log: Path) -> dict:
    """The plugin logs the engine's pause answer: "paused (ok cpu rank=0 snapshot=ID ...)"."""
    m = re.search(r"paused \((ok \w+(?: \w+=\S+)*)\)", log.read_text(errors="replace")) if log.exists() else None
    return parse_answer(m[1]) if m else {}


def parse_answer(reply: str) -> dict:
    """An engine's pause answer "ok cpu rank=0 snapshot=ID written=N deduplicated=M" as a dict."""
    m = re.fullmatch(r"ok (\w+)((?: \w+=\S+)*)", reply.strip())
    if not m:
        return {}
    return {"device": m[1], **dict(kv.split("=", 1) for kv in m[2].split())}


def resume_unnotified(pid: int, log: Path) -> bool:
    """After a failed or killed dump: tell the engine ``pid`` to resume if the plugin asked it to pause but
    did not tell it to resume (its pause timed out, or CRIU was killed). Returns whether it was told."""
    text = log.read_text(errors="replace") if log.exists() else ""
    if f"engine {pid}: pause" not in text or f"engine {pid}: told to resume" in text:
        return False
    from .hooks import send_request

    try:
        send_request(pid, "resume -", wait_reply=False)
    except OSError:
        return False
    return True


def netns_of(pid: int) -> tuple[int, int]:
    st = os.stat(f"/proc/{pid}/ns/net")
    return st.st_dev, st.st_ino


def in_netns(netns_path: str | None) -> list[str]:
    return ["nsenter", f"--net={netns_path}"] if netns_path else []


def common_args(images: Path, use_plugin: bool) -> list[str]:
    """Options of both dump and restore; without the plugin, ``-L`` names an empty directory."""
    if use_plugin:
        plugins = tools.plugin_dir()
    else:
        plugins = images / "no-plugins"
        mkdir_private(plugins)
    return ["--tcp-close", "--ext-unix-sk", "--file-locks", "--link-remap", "-L", str(plugins)]


def run_criu(action: str, args: list[str], images: Path, netns_path: str | None, timeout_s: float | None,
             env: dict | None = None) -> float:
    log = images / f"{action}.log"
    cmd = [*in_netns(netns_path), str(tools.criu_binary()), action, "-D", str(images), "-o", log.name, "-v4", *args]
    t = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired:
        raise CriuError(action, log, f"did not finish within {timeout_s:g} s", None, timed_out=True) from None
    if done.returncode != 0:
        raise CriuError(action, log, first_error(log) or done.stderr.strip()[-300:] or None, done.returncode)
    return time.perf_counter() - t


def dump(pid: int, images: Path, *, leave_running: bool = False, use_plugin: bool = True,
         timeout_s: float | None = None, hook_timeout_s: int | None = None) -> DumpResult:
    """Checkpoint process ``pid`` (and its children) into ``images`` (a new, private directory).
    ``hook_timeout_s`` bounds the engine's pause (the plugin gives up and CRIU aborts cleanly);
    ``timeout_s`` bounds the whole CRIU run (it is killed then)."""
    if not Path(f"/proc/{pid}").exists():
        raise PodsnapError(f"no process with pid {pid}")
    mkdir_private(images)
    if any(images.glob("*.img")):
        raise PodsnapError(f"{images} already holds a checkpoint; give a new directory")
    shell_job = os.getsid(pid) != pid
    args = ["-t", str(pid), *common_args(images, use_plugin)]
    if shell_job:
        args.append("--shell-job")
    if leave_running:
        args.append("--leave-running")
    netns = None if netns_of(pid) == netns_of(os.getpid()) else f"/proc/{pid}/ns/net"
    env = {"PODSNAP_HOOK_TIMEOUT": str(max(1, int(hook_timeout_s)))} if hook_timeout_s else None
    try:
        seconds = run_criu("dump", args, images, netns, timeout_s, env)
    except CriuError:
        resume_unnotified(pid, images / "dump.log")
        raise
    engine = engine_answer(images / "dump.log")
    ProcessInfo(pid, shell_job, engine, time.time()).write(images)
    return DumpResult(pid, images, seconds, image_bytes(images), engine, leave_running)


class GroupDumpError(PodsnapError):
    def __init__(self, errors: dict[int, PodsnapError]):
        self.errors = errors
        self.timed_out = any(getattr(e, "timed_out", False) for e in errors.values())
        super().__init__("checkpoint failed; the engines that paused resume:\n  "
                         + "\n  ".join(f"pid {pid}: {e}" for pid, e in errors.items()))


def dump_group(pids: list[int], images_of: Callable[[int], Path], *, leave_running: bool = False,
               use_plugin: bool = True, timeout_s: float | None = None,
               hook_timeout_s: int | None = None) -> list[DumpResult]:
    """Dump the processes of one engine group at the same time (a follower pauses when rank 0 does);
    raises GroupDumpError naming each process that failed."""
    with ThreadPoolExecutor(max(1, len(pids))) as pool:
        futures = {pid: pool.submit(dump, pid, images_of(pid), leave_running=leave_running, use_plugin=use_plugin,
                                    timeout_s=timeout_s, hook_timeout_s=hook_timeout_s) for pid in pids}
        results, errors = [], {}
        for pid, f in futures.items():
            try:
                results.append(f.result())
            except PodsnapError as e:
                errors[pid] = e
    if errors:
        raise GroupDumpError(errors)
    return results


class InvalidNetns(PodsnapError):
    """A network namespace name that could be a path (or is empty)."""


class NetnsNotFound(PodsnapError):
    pass


def netns_path(name: str) -> str:
    """``/run/netns/NAME`` for a namespace created with ``ip netns add NAME``; the name is checked
    (the CLI's ``--netns`` and the agent's requests alike)."""
    if not NETNS_NAME.match(name):
        raise InvalidNetns(f"{name!r} is not a network namespace name (letters, digits, '_', '.', '-'), so not a "
                           "name from `ip netns list`")
    path = f"/run/netns/{name}"
    if not os.path.exists(path):
        raise NetnsNotFound(f"network namespace {name!r} does not exist ({path}); create it with `ip netns add`")
    return path


def restore(images: Path, *, netns: str | None = None, metadata: Path | None = None,
            timeout_s: float | None = None, use_plugin: bool = True) -> tuple[int, float]:
    """Restore the checkpoint in ``images`` detached, inside network namespace ``netns`` (a name
    from ``ip netns``); returns (pid, seconds). ``metadata`` (new master, generation) reaches the
    engine through the plugin's resume event."""
    info = ProcessInfo.read(images)
    ns = netns_path(netns) if netns else None
    args = ["-d", "--pidfile", str(images / "restored.pid"), *common_args(images, use_plugin)]
    if info.shell_job:
        args.append("--shell-job")
    env = {"PODSNAP_RESTORE_METADATA": str(Path(metadata).resolve())} if metadata else {}
    seconds = run_criu("restore", args, images, ns, timeout_s, env)
    return int((images / "restored.pid").read_text()), seconds
