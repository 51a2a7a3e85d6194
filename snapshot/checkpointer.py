"""The agent's operations: checkpoint containers and pods into archives, restore them.

Each operation runs under a deadline (the CRI ``timeout`` in seconds, 0 = the
agent's default, and the gRPC call's own deadline, whichever is first) and
holds a lock per container: requests for one container run one after the
other, requests for different containers in parallel. A checkpoint dumps the
group's processes together through the plugin (each engine puts its state in
the store and drops it), writes one archive per container and removes the
CRIU images; on any failure, a timeout included, the archives and images of
the operation are removed and the engines are resumed (the plugin tells the
engines that paused; ``driver.resume_unnotified`` tells one whose pause the
deadline cut short).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from podsnap.comm_rebuild.discovery import from_metadata_file
from podsnap.criu_plugin import driver
from podsnap.criu_plugin.hooks import send_request
from podsnap.errors import PodsnapError

from .archive import ArchiveExists, ArchiveInfo, extract_images, process_cmdline, read_info, write_archive
from .registry import ContainerEntry, Registry, check_name, process_start_time
from .resolve import Target
from .store import Store, StoreError, mkdir_private, write_private

KILL_GRACE_S = 10.0  # CRIU is killed this long after the deadline if the plugin's own timeout did not end it
POD_FILE = "pod.json"


class InvalidRequest(PodsnapError):
    pass


class DeadlineExceeded(PodsnapError):
    pass


class NotFound(PodsnapError):
    pass


@dataclass
class Deadline:
    at: float  # time.monotonic()
    seconds: float
    what: str

    @classmethod
    def start(cls, timeout_s: int, default_s: float, grpc_remaining: float | None, what: str) -> Deadline:
        if timeout_s < 0:
            raise InvalidRequest(f"timeout {timeout_s} is negative; give seconds > 0, or 0 for the default "
                                 f"({default_s:g} s)")
        seconds = float(timeout_s) if timeout_s > 0 else default_s
        if grpc_remaining is not None:
            seconds = min(seconds, grpc_remaining)
        return cls(time.monotonic() + seconds, seconds, what)

    def remaining(self) -> float:
        return self.at - time.monotonic()

    def expired(self) -> bool:
        return self.remaining() <= 0

    def check(self, stage: str = "") -> None:
        if self.expired():
            raise DeadlineExceeded(f"{self.what} did not finish within its timeout of {self.seconds:g} s"
                                   f"{' (' + stage + ')' if stage else ''}; nothing was kept and the engine resumes")


@dataclass
class Operation:
    """An operation in flight, as Status reports it."""
    op_id: str
    kind: str
    containers: list[str]
    state: str = "waiting for lock"
    started: float = field(default_factory=time.time)

    def describe(self) -> str:
        return f"{self.op_id} {self.kind} {','.join(self.containers)} {self.state}"


class KeyedLocks:
    def __init__(self):
        self.mutex = threading.Lock()
        self.locks: dict[str, threading.Lock] = {}

    @contextmanager
    def hold(self, keys: list[str], deadline: Deadline) -> Iterator[None]:
        """Lock every key (sorted: no deadlock between overlapping sets) before the deadline."""
        with self.mutex:
            locks = [self.locks.setdefault(k, threading.Lock()) for k in sorted(set(keys))]
        held = []
        try:
            for k, lock in zip(sorted(set(keys)), locks, strict=True):
                if not lock.acquire(timeout=max(0.0, deadline.remaining())):
                    raise DeadlineExceeded(f"{deadline.what}: container {k!r} was busy with another request "
                                           f"for the whole timeout of {deadline.seconds:g} s")
                held.append(lock)
            yield
        finally:
            for lock in reversed(held):
                lock.release()


@dataclass
class CheckpointResult:
    container_id: str
    archive: str  # "" for an engine snapshot without a process dump
    store: str | None
    snapshot: str | None
    pid: int
    image_bytes: int
    archive_bytes: int
    bytes_written: int
    bytes_deduplicated: int
    seconds: float


@dataclass
class RestoreResult:
    container_id: str
    pod_id: str
    pid: int
    seconds: float


def process_started_at(pid: int) -> float:
    """Wall-clock start time of ``pid`` (boot time + start ticks)."""
    btime = next(int(x.split()[1]) for x in Path("/proc/stat").read_text().splitlines() if x.startswith("btime"))
    return btime + (process_start_time(pid) or 0) / os.sysconf("SC_CLK_TCK")


class Checkpointer:
    def __init__(self, checkpoint_dir: Path, state_dir: Path, registry: Registry | None, metrics=None):
        self.checkpoint_dir, self.state_dir, self.registry = Path(checkpoint_dir), Path(state_dir), registry
        self.metrics = metrics
        self.locks = KeyedLocks()
        self.ops: dict[str, Operation] = {}
        self.ops_lock = threading.Lock()

    # --- bookkeeping -------------------------------------------------------------------------

    @contextmanager
    def operation(self, kind: str, containers: list[str], deadline: Deadline) -> Iterator[Operation]:
        op = Operation(f"op-{os.urandom(4).hex()}", kind, containers)
        with self.ops_lock:
            self.ops[op.op_id] = op
        try:
            with self.locks.hold(containers, deadline):
                op.state = "running"
                yield op
        finally:
            with self.ops_lock:
                del self.ops[op.op_id]

    def in_flight(self) -> list[Operation]:
        with self.ops_lock:
            return list(self.ops.values())

    def work_dir(self, kind: str, op: Operation) -> Path:
        path = self.state_dir / kind / op.op_id
        mkdir_private(path.parent)
        path.mkdir(mode=0o700)
        return path

    # --- checkpoint ----------------------------------------------------------------------------

    def checkpoint(self, targets: list[Target], locations: list[Path], deadline: Deadline, *,
                   leave_running: bool, kind: str) -> list[CheckpointResult]:
        """Dump ``targets`` together and write archive ``locations[i]`` of ``targets[i]`` (all or none)."""
        with self.operation(kind, [t.container_id for t in targets], deadline) as op:
            deadline.check("waiting for the container")
            for loc in locations:
                if loc.exists():
                    raise ArchiveExists(f"{loc} already exists; give a new location")
            cmdlines = {t.pid: process_cmdline(t.pid) for t in targets}
            created = {t.pid: process_started_at(t.pid) for t in targets}
            work = self.work_dir("work", op)
            written: list[Path] = []
            try:
                dumps = self._dump(targets, work, deadline, leave_running)
                results = []
                for t, loc in zip(targets, locations, strict=True):
                    d = dumps[t.pid]
                    info = archive_info(t, d)
                    size = write_archive(loc, d.images, info, created=created[t.pid], cmdline=cmdlines[t.pid],
                                         check=lambda: deadline.check("writing the archive"))
                    written.append(loc)
                    results.append(result_of(t, d, str(loc), size))
                deadline.check("writing the archives")
                return results
            except BaseException:
                for loc in written:
                    loc.unlink(missing_ok=True)
                raise
            finally:
                shutil.rmtree(work, ignore_errors=True)

    def _dump(self, targets: list[Target], work: Path, deadline: Deadline,
              leave_running: bool) -> dict[int, driver.DumpResult]:
        remaining = deadline.remaining()
        try:
            dumps = driver.dump_group([t.pid for t in targets], lambda pid: work / f"pid-{pid}",
                                      leave_running=leave_running, timeout_s=remaining + KILL_GRACE_S,
                                      hook_timeout_s=max(1, math.ceil(remaining)))
        except driver.GroupDumpError as e:
            if e.timed_out or deadline.expired():
                raise DeadlineExceeded(f"{deadline.what} did not finish within its timeout of {deadline.seconds:g} s;"
                                       f" CRIU was stopped, nothing was kept and the engine resumes ({e})") from None
            raise
        deadline.check("dumping")
        by_pid = {d.pid: d for d in dumps}
        for t in targets:  # the archive references the snapshot: it must be in the store
            snap = by_pid[t.pid].engine.get("snapshot")
            if t.store and snap:
                try:
                    Store(t.store, create=False).load(snap)
                except (StoreError, PodsnapError) as e:
                    raise PodsnapError(f"container {t.container_id!r}: the engine's snapshot is not readable ({e})") \
                        from None
        return by_pid

    def snapshot_engines(self, targets: list[Target], deadline: Deadline) -> list[CheckpointResult]:
        """An engine snapshot without a process dump: pause the group through the hook sockets (each engine
        writes its state to the store), then resume it."""
        with self.operation("snapshot", [t.container_id for t in targets], deadline):
            t0 = time.perf_counter()
            with ThreadPoolExecutor(len(targets)) as pool:
                futures = {t.pid: pool.submit(ask_pause, t.pid, deadline) for t in targets}
                answers = {pid: f.result() for pid, f in futures.items()}
            for pid, answer in answers.items():
                if not answer.startswith("error"):
                    try:
                        send_request(pid, "resume -", wait_reply=False)
                    except OSError:
                        pass
            failed = {pid: a for pid, a in answers.items() if not a.startswith("ok")}
            if failed:
                if deadline.expired():
                    deadline.check("pausing the engines")
                raise PodsnapError("engine snapshot failed: " + "; ".join(f"pid {p}: {a or 'no answer'}"
                                                                          for p, a in failed.items()))
            seconds = time.perf_counter() - t0
            out = []
            for t in targets:
                eng = driver.parse_answer(answers[t.pid])
                d = driver.DumpResult(t.pid, Path(), seconds, 0, eng, True)
                out.append(result_of(t, d, "", 0))
            return out

    # --- restore -------------------------------------------------------------------------------

    def restore(self, archive: Path, deadline: Deadline, netns: str | None, metadata_json: str | None,
                container_id: str | None = None) -> RestoreResult:
        info = read_info(archive)
        cid = check_name(container_id or info.container_id)
        metadata = self.metadata_file(cid, metadata_json)
        with self.operation("restore", [cid], deadline) as op:
            if info.store and info.snapshot:
                try:
                    Store(info.store, create=False).load(info.snapshot)
                except PodsnapError as e:
                    raise NotFound(f"archive {archive} references snapshot {info.snapshot!r} in {info.store}, "
                                   f"which cannot be read: {e}") from None
            work = self.work_dir("restores", op)
            try:
                images = extract_images(archive, work / "unpacked")
                deadline.check("unpacking")
                pid, seconds = driver.restore(images, netns=netns, metadata=metadata,
                                              timeout_s=max(1.0, deadline.remaining()))
            except driver.CriuError as e:
                kept = self.keep_log(e.log, op)
                if e.timed_out:
                    raise DeadlineExceeded(f"restore of {cid!r} did not finish within {deadline.seconds:g} s "
                                           f"[log: {kept}]") from None
                raise driver.CriuError(e.action, kept or e.log, e.line, None) from None
            finally:
                shutil.rmtree(work, ignore_errors=True)
            if self.registry is not None:
                self.registry.register(ContainerEntry.for_process(cid, info.pod_name, info.namespace or "default",
                                                                  info.container_name, pid, info.store))
            return RestoreResult(cid, info.pod_name, pid, seconds)

    def metadata_file(self, container_id: str, metadata_json: str | None) -> Path | None:
        """Write the restore metadata where the restored engine reads it (and polls it later)."""
        if not metadata_json:
            return None
        path = self.state_dir / "metadata" / f"{container_id}.json"
        mkdir_private(path.parent)
        tmp = path.with_name(f".{path.name}.{os.urandom(4).hex()}")
        write_private(tmp, metadata_json.encode())
        try:
            from_metadata_file(tmp)
        except PodsnapError as e:
            tmp.unlink()
            raise InvalidRequest(str(e).replace(str(tmp), "restore_metadata")) from None
        os.replace(tmp, path)
        return path

    def keep_log(self, log: Path, op: Operation) -> Path | None:
        """Keep CRIU's log of a failed restore (the work directory is removed) under STATE/logs."""
        if not log.exists():
            return None
        mkdir_private(self.state_dir / "logs")
        kept = self.state_dir / "logs" / f"{op.op_id}-{log.name}"
        shutil.copyfile(log, kept)
        return kept

    # --- pods ----------------------------------------------------------------------------------

    def checkpoint_pod(self, pod_id: str, targets: list[Target], path: Path, deadline: Deadline,
                       leave_running: bool) -> list[CheckpointResult]:
        """A pod checkpoint: directory ``path`` with one archive per container and pod.json."""
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:
            raise ArchiveExists(f"{path} already exists; CheckpointPod writes into a new directory") from None
        try:
            results = self.checkpoint(targets, [path / f"{t.container_id}.tar" for t in targets], deadline,
                                      leave_running=leave_running, kind="checkpoint-pod")
            pod = {"pod_id": pod_id, "pod_name": targets[0].pod_name, "namespace": targets[0].namespace,
                   "containers": [t.container_id for t in targets], "created": time.time()}
            write_private(path / POD_FILE, json.dumps(pod, indent=1).encode())
            return results
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise

    def restore_pod(self, path: Path, deadline: Deadline, netns: str | None,
                    metadata_json: str | None) -> list[RestoreResult]:
        try:
            pod = json.loads((path / POD_FILE).read_text())
            containers = [check_name(c) for c in pod["containers"]]
        except FileNotFoundError:
            raise NotFound(f"{path} holds no pod checkpoint ({POD_FILE} is missing)") from None
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise InvalidRequest(f"{path / POD_FILE} is not a podsnap pod checkpoint ({e})") from None
        return [self.restore(path / f"{c}.tar", deadline, netns, metadata_json) for c in containers]


def ask_pause(pid: int, deadline: Deadline) -> str:
    try:
        return send_request(pid, "pause", timeout_s=max(0.1, deadline.remaining()))
    except TimeoutError:
        return ""
    except OSError as e:
        return f"error the engine's hook socket does not answer ({e}); is it a podsnap engine with a --store?"


def archive_info(t: Target, d: driver.DumpResult) -> ArchiveInfo:
    return ArchiveInfo(t.container_id, t.container_name, t.pod_name, t.namespace, t.pid, t.store,
                       d.engine.get("snapshot"), d.engine, time.time(), d.image_bytes)


def result_of(t: Target, d: driver.DumpResult, archive: str, size: int) -> CheckpointResult:
    return CheckpointResult(t.container_id, archive, t.store, d.engine.get("snapshot"), t.pid, d.image_bytes, size,
                            int(d.engine.get("written", 0)), int(d.engine.get("deduplicated", 0)), d.seconds)
