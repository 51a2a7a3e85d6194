"""Helpers for the agent tests: an in-process agent on real Unix sockets, a stand-in CRI runtime, slow engines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from podsnap.snapshot.agent import Agent, AgentConfig
from podsnap.snapshot.client import AgentClient
from podsnap.snapshot.proxy import identity
from podsnap.snapshot.rpc import cri_pb2

HERE = Path(__file__).resolve().parent


@dataclass
class RecordedCall:
    method: str
    request: bytes


@dataclass
class FakeRuntime:
    """A gRPC server on a Unix socket standing for containerd/CRI-O: it records every request's raw bytes and
    answers with canned bytes; ContainerStatus reports the pid of the containers in ``pids``."""
    socket: Path
    pids: dict[str, int] = field(default_factory=dict)
    calls: list[RecordedCall] = field(default_factory=list)
    events: list[bytes] = field(default_factory=list)

    VERSION = cri_pb2.VersionResponse(version="0.1.0", runtime_name="fake-runtime", runtime_version="9.9",
                                      runtime_api_version="v1").SerializeToString()

    def start(self) -> FakeRuntime:
        self.server = grpc.server(futures.ThreadPoolExecutor(8))
        self.server.add_generic_rpc_handlers([self])
        self.server.add_insecure_port(f"unix://{self.socket}")
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop(0).wait()

    def service(self, details):
        method = details.method
        if method.endswith("/GetContainerEvents"):
            return grpc.unary_stream_rpc_method_handler(lambda req, ctx: self._events(method, req),
                                                        request_deserializer=identity, response_serializer=identity)
        return grpc.unary_unary_rpc_method_handler(lambda req, ctx: self._unary(method, req, ctx),
                                                   request_deserializer=identity, response_serializer=identity)

    def _events(self, method, request):
        self.calls.append(RecordedCall(method, request))
        yield from self.events

    def _unary(self, method: str, request: bytes, context) -> bytes:
        self.calls.append(RecordedCall(method, request))
        name = method.rsplit("/", 1)[1]
        if name == "Version":
            return self.VERSION
        if name == "ListContainers":
            return self.list_containers().SerializeToString()
        if name == "ContainerStatus":
            req = cri_pb2.ContainerStatusRequest.FromString(request)
            if req.container_id not in self.pids:
                context.abort(grpc.StatusCode.NOT_FOUND, f"container {req.container_id!r} does not exist")
            return self.status(req.container_id).SerializeToString()
        context.abort(grpc.StatusCode.UNIMPLEMENTED, f"fake runtime: {method} is not implemented")

    def list_containers(self):
        return cri_pb2.ListContainersResponse(containers=[
            cri_pb2.Container(id=c, pod_sandbox_id=f"sandbox-{c}", metadata=cri_pb2.ContainerMetadata(name="engine"),
                              state=cri_pb2.CONTAINER_RUNNING, labels={"io.kubernetes.pod.name": f"pod-{c}"})
            for c in sorted(self.pids)])

    def status(self, container_id: str):
        info = {"pid": self.pids[container_id], "sandboxID": f"sandbox-{container_id}"}
        return cri_pb2.ContainerStatusResponse(
            status=cri_pb2.ContainerStatus(id=container_id, metadata=cri_pb2.ContainerMetadata(name="engine"),
                                           state=cri_pb2.CONTAINER_RUNNING,
                                           labels={"io.kubernetes.pod.name": f"pod-{container_id}",
                                                   "io.kubernetes.pod.namespace": "llm"}),
            info={"info": json.dumps(info)})


class RunningAgent:
    """An Agent served in this process (real gRPC on real Unix sockets), and a client of its public socket."""

    def __init__(self, base: Path, checkpoint_dir: Path, **overrides):
        self.config = AgentConfig(socket=base / "agent.sock", checkpoint_dir=checkpoint_dir, state_dir=base / "state",
                                  default_timeout_s=300, **overrides)
        self.agent = Agent(self.config).start()
        self.client = AgentClient(self.config.socket)

    def stop(self) -> None:
        self.client.close()
        self.agent.stop()

    def in_flight(self) -> list[str]:
        return list(self.client.status().in_flight)


class SlowEngine:
    """tests/slow_engine.py in a process of its own (session leader, output to a file)."""

    def __init__(self, container_id: str, workdir: Path):
        self.events = workdir / f"{container_id}.events"
        self.release = workdir / f"{container_id}.release"
        self.log = workdir / f"{container_id}.log"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen([sys.executable, str(HERE / "slow_engine.py"), container_id,
                                          str(self.events), str(self.release)], stdout=out,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.pid = self.proc.pid
        self.wait_events(["ready"])

    def seen(self) -> list[str]:
        return self.events.read_text().split() if self.events.exists() else []

    def wait_events(self, expected: list[str], timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while self.seen()[:len(expected)] != expected or len(self.seen()) < len(expected):
            assert self.proc.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, f"events {self.seen()}, expected {expected}: {self.log.read_text()}"
            time.sleep(0.02)

    def allow(self) -> None:
        self.release.touch()


def wait_until(predicate, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.02)


def in_thread(fn, *args) -> tuple[threading.Thread, dict]:
    """Run ``fn(*args)`` on a thread; the dict gets "result" or "error"."""
    out: dict = {}

    def run():
        try:
            out["result"] = fn(*args)
        except Exception as e:  # noqa: BLE001 - the test inspects it
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def files_under(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*")) if path.exists() else []


def short_dir(prefix: str) -> Path:
    """A short private directory in /tmp (Unix socket paths have at most 107 bytes)."""
    d = Path(f"/tmp/{prefix}-{os.urandom(3).hex()}")
    d.mkdir(mode=0o700)
    return d
