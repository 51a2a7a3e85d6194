"""Standalone mode: which process is which container.

Without a container runtime to ask, ``podsnap serve --container-id ID
--pod-name POD`` registers its rank process in a registry directory
(``PODSNAP_AGENT_REGISTRY``, default ``/run/podsnap/agent/registry``, 0700):
one JSON file per container with the pid, the process's start time (so a
reused pid is not mistaken for the container), its network namespace, pod
name and namespace, and the snapshot store it writes to. The file is written
atomically and removed when the process exits. The agent reads the directory
on every lookup, so pods may start before or after it and an agent restart
loses nothing; an entry whose process is gone, or whose file is owned by
neither root nor the process's user, is ignored. A directory rather than an
RPC to the agent: registering works whether or not the agent runs, and needs
no socket access from the pod.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from podsnap.errors import PodsnapError

from .store import mkdir_private, write_atomic

DEFAULT_REGISTRY_DIR = "/run/podsnap/agent/registry"
ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class InvalidName(PodsnapError):
    """A container id, pod name or namespace that could be used as a path (or is empty)."""


class ContainerNotFound(PodsnapError):
    pass


def check_name(value: str, what: str = "container id") -> str:
    if not isinstance(value, str) or not ID_RE.match(value):
        raise InvalidName(f"{what} {value!r} is not valid: use 1-128 letters, digits, '.', '_' or '-', starting "
                          "with a letter or digit (no '/', no '..', no spaces)")
    return value


def registry_dir() -> Path:
    return Path(os.environ.get("PODSNAP_AGENT_REGISTRY") or DEFAULT_REGISTRY_DIR)


def process_start_time(pid: int) -> int | None:
    """Clock ticks after boot at which ``pid`` started (field 22 of /proc/PID/stat); None if it is gone."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def netns_id(pid: int) -> str:
    """``net:[inode]`` of the process's network namespace."""
    return os.readlink(f"/proc/{pid}/ns/net")


@dataclass(frozen=True)
class ContainerEntry:
    container_id: str
    container_name: str
    pod_name: str
    namespace: str
    pid: int
    start_time: int
    netns: str
    store: str | None = None
    registered_at: float = 0.0

    @classmethod
    def for_process(cls, container_id: str, pod_name: str, namespace: str = "default",
                    container_name: str | None = None, pid: int | None = None,
                    store: str | None = None) -> ContainerEntry:
        pid = pid or os.getpid()
        start = process_start_time(pid)
        if start is None:
            raise ContainerNotFound(f"no process with pid {pid} to register as container {container_id!r}")
        return cls(check_name(container_id), check_name(container_name or container_id, "container name"),
                   check_name(pod_name, "pod name"), check_name(namespace, "namespace"), pid, start,
                   netns_id(pid), store, time.time())

    def alive(self) -> bool:
        return process_start_time(self.pid) == self.start_time


class Registry:
    def __init__(self, root: str | Path | None = None):
        self.root = Path(root) if root else registry_dir()

    def path(self, container_id: str) -> Path:
        return self.root / f"{check_name(container_id)}.json"

    def register(self, entry: ContainerEntry) -> Path:
        mkdir_private(self.root)
        path = self.path(entry.container_id)
        write_atomic(path, json.dumps(asdict(entry)).encode())
        return path

    def unregister(self, container_id: str, pid: int | None = None) -> None:
        """Remove the entry (only if it is still ``pid``'s, when given)."""
        path = self.path(container_id)
        entry = self._read(path)
        if entry is not None and (pid is None or entry.pid == pid):
            path.unlink(missing_ok=True)

    def _read(self, path: Path) -> ContainerEntry | None:
        try:
            st = path.stat()
            entry = ContainerEntry(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            return None
        try:
            owner = os.stat(f"/proc/{entry.pid}").st_uid
        except OSError:
            return None
        if st.st_uid not in (0, os.getuid(), owner) or not ID_RE.match(entry.container_id):
            return None
        return entry

    def get(self, container_id: str) -> ContainerEntry:
        entry = self._read(self.path(container_id))
        if entry is None or not entry.alive():
            known = ", ".join(e.container_id for e in self.entries()[:5]) or "none"
            raise ContainerNotFound(f"no running container {container_id!r} in the registry {self.root} "
                                    f"(running: {known}); start the pod with `podsnap serve --container-id ...`")
        return entry

    def entries(self) -> list[ContainerEntry]:
        """The live entries, by container id."""
        if not self.root.is_dir():
            return []
        found = (self._read(p) for p in sorted(self.root.glob("*.json")))
        return [e for e in found if e is not None and e.alive()]
