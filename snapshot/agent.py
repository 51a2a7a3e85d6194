"""The snapshot agent: a node-local gRPC server (one per node, a DaemonSet) speaking CRI ``runtime.v1``.

It handles ``CheckpointContainer`` (the kubelet's checkpoint API), and KEP-5823's
``CheckpointPod`` / ``RestorePod``, plus podsnap's own ``podsnap.agent.v1.Agent``
service (Snapshot, Restore, List, Status) for the controller and the CLI.

- Proxy mode (``runtime_socket`` set): the kubelet is pointed at the agent's
  socket; every other RuntimeService/ImageService call is forwarded unchanged
  (``proxy.PassthroughHandler``), and containers are found through the
  runtime's ContainerStatus.
- Standalone mode: containers are found in the registry ``podsnap serve
  --container-id`` writes; other CRI methods answer UNIMPLEMENTED.

The public socket is owned by ``peercred.PeerCredGuard`` (0600/0660 and a
SO_PEERCRED uid/gid check per connection); gRPC itself listens on a socket in
a 0700 directory under the state directory. Errors map to gRPC status codes:
INVALID_ARGUMENT (bad ids, names, locations, timeouts, metadata), NOT_FOUND
(unknown container, pod, archive, snapshot), DEADLINE_EXCEEDED, UNAVAILABLE
(runtime unreachable), ALREADY_EXISTS (the location is taken), INTERNAL
(CRIU failed: the message quotes its log).
"""

from __future__ import annotations

import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc

from podsnap import __version__
from podsnap.criu_plugin import driver
from podsnap.errors import PodsnapError

from .archive import ArchiveExists, LocationRefused, confine, read_info
from .checkpointer import Checkpointer, CheckpointResult, Deadline, DeadlineExceeded, InvalidRequest, NotFound
from .metrics import AgentMetrics
from .peercred import AccessPolicy, Peer, PeerCredGuard
from .proxy import MESSAGE_LIMITS, PassthroughHandler, runtime_channel
from .registry import ContainerNotFound, InvalidName, Registry, check_name
from .resolve import RegistryResolver, RuntimeResolver, RuntimeUnavailable
from .rpc import AGENT, CRI_RUNTIME, agent_pb2, cri_pb2
from .store import mkdir_private, new_snapshot_id

DEFAULT_SOCKET = "/run/podsnap/agent.sock"
DEFAULT_CHECKPOINT_DIR = "/var/lib/kubelet/checkpoints"
DEFAULT_STATE_DIR = "/run/podsnap/agent"
NETNS_OPTION = "podsnap.io/netns"
METADATA_OPTION = "podsnap.io/restore-metadata"


@dataclass
class AgentConfig:
    socket: Path = Path(DEFAULT_SOCKET)
    checkpoint_dir: Path = Path(DEFAULT_CHECKPOINT_DIR)
    state_dir: Path = Path(DEFAULT_STATE_DIR)
    store: str | None = None  # for containers whose registry entry (or annotation) names none
    runtime_socket: str | None = None  # proxy mode
    registry_dir: Path | None = None  # standalone mode (default: PODSNAP_AGENT_REGISTRY or /run/podsnap/agent/registry)
    socket_mode: int = 0o600
    socket_group: int | None = None
    allow_uids: frozenset[int] = frozenset()
    allow_gids: frozenset[int] = frozenset()
    default_timeout_s: float = 300.0
    metrics_port: int | None = None
    workers: int = 32

    @property
    def mode(self) -> str:
        return "proxy" if self.runtime_socket else "standalone"

    @property
    def private_socket(self) -> Path:
        return self.state_dir / "private" / "grpc.sock"


ERROR_CODES: list[tuple[type, grpc.StatusCode, str]] = [
    (InvalidName, grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument"),
    (LocationRefused, grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument"),
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument"),
    (ContainerNotFound, grpc.StatusCode.NOT_FOUND, "not_found"),
    (NotFound, grpc.StatusCode.NOT_FOUND, "not_found"),
    (DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED, "deadline_exceeded"),
    (RuntimeUnavailable, grpc.StatusCode.UNAVAILABLE, "unavailable"),
    (ArchiveExists, grpc.StatusCode.ALREADY_EXISTS, "already_exists"),
    (driver.InvalidNetns, grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument"),
    (driver.NetnsNotFound, grpc.StatusCode.NOT_FOUND, "not_found"),
]


def status_of(e: BaseException) -> tuple[grpc.StatusCode, str]:
    for cls, code, result in ERROR_CODES:
        if isinstance(e, cls):
            return code, result
    return grpc.StatusCode.INTERNAL, "error"


def log(msg: str) -> None:
    print(f"podsnap-agent: {msg}", file=sys.stderr, flush=True)


class Agent:
    def __init__(self, config: AgentConfig):
        self.config = config
        self.started = time.time()
        self.metrics = AgentMetrics.create()
        self.channel = runtime_channel(config.runtime_socket) if config.runtime_socket else None
        self.registry = None if self.channel else Registry(config.registry_dir)
        self.resolver = (RuntimeResolver(self.channel, config.store) if self.channel
                         else RegistryResolver(self.registry, config.store))
        self.checkpointer = Checkpointer(config.checkpoint_dir, config.state_dir, self.registry, self.metrics)
        self.server: grpc.Server | None = None
        self.guard: PeerCredGuard | None = None
        self.metrics_server = None

    # --- life cycle -------------------------------------------------------------------------------

    def start(self) -> Agent:
        cfg = self.config
        if not cfg.checkpoint_dir.is_dir():
            raise PodsnapError(f"checkpoint directory {cfg.checkpoint_dir} does not exist; create it (the kubelet's "
                               "is /var/lib/kubelet/checkpoints) or give --checkpoint-dir")
        mkdir_private(cfg.state_dir)
        mkdir_private(cfg.private_socket.parent)
        cfg.private_socket.unlink(missing_ok=True)
        self.server = grpc.server(ThreadPoolExecutor(cfg.workers, thread_name_prefix="podsnap-agent"),
                                  options=MESSAGE_LIMITS)
        handlers = [self._cri_handler(), self._agent_handler()]
        if self.channel is not None:
            handlers.append(PassthroughHandler(self.channel))
        self.server.add_generic_rpc_handlers(handlers)
        self.server.add_insecure_port(f"unix://{cfg.private_socket}")
        self.server.start()
        self.guard = PeerCredGuard(cfg.socket, cfg.private_socket, AccessPolicy(cfg.allow_uids, cfg.allow_gids),
                                   cfg.socket_mode, cfg.socket_group, on_refused=self._refused)
        if cfg.metrics_port is not None:
            self.metrics_server = self.metrics.serve(cfg.metrics_port)
        log(f"serving on {cfg.socket} ({cfg.mode} mode"
            f"{', runtime ' + cfg.runtime_socket if cfg.runtime_socket else ''}); checkpoints in {cfg.checkpoint_dir}"
            f"{'; metrics on :' + str(cfg.metrics_port) if cfg.metrics_port is not None else ''}")
        return self

    def stop(self, grace_s: float = 1.0) -> None:
        if self.guard:
            self.guard.close()
        if self.server:
            self.server.stop(grace_s).wait()
        if self.metrics_server:
            self.metrics_server.shutdown()
        if self.channel:
            self.channel.close()
        self.config.private_socket.unlink(missing_ok=True)

    def _refused(self, peer: Peer) -> None:
        self.metrics.refused_connections.inc()
        log(f"refused a connection from pid {peer.pid} (uid {peer.uid}, gid {peer.gid}): not root, not the "
            "agent's user and not in --allow-uid/--allow-gid")

    # --- gRPC plumbing ------------------------------------------------------------------------------

    def _unary(self, name: str, fn, request_type, response_type, counted: str | None = None):
        """A handler for ``fn``; ``counted``: "restore" or a checkpoint kind, whose failures are counted."""
        def handle(request, context: grpc.ServicerContext):
            try:
                return fn(request, context)
            except Exception as e:  # noqa: BLE001 - every failure becomes a status with a message
                code, result = status_of(e)
                if counted:
                    self._count_failure(counted, result)
                if code == grpc.StatusCode.INTERNAL and not isinstance(e, PodsnapError):
                    traceback.print_exc()
                    message = f"{name} failed: {type(e).__name__}: {e}"
                else:
                    message = str(e)
                context.abort(code, message)

        return grpc.unary_unary_rpc_method_handler(handle, request_deserializer=request_type.FromString,
                                                   response_serializer=response_type.SerializeToString)

    def _cri_handler(self):
        return grpc.method_handlers_generic_handler(CRI_RUNTIME, {
            "CheckpointContainer": self._unary("CheckpointContainer", self.checkpoint_container,
                                               cri_pb2.CheckpointContainerRequest, cri_pb2.CheckpointContainerResponse,
                                               "container"),
            "CheckpointPod": self._unary("CheckpointPod", self.checkpoint_pod, cri_pb2.CheckpointPodRequest,
                                         cri_pb2.CheckpointPodResponse, "pod"),
            "RestorePod": self._unary("RestorePod", self.restore_pod, cri_pb2.RestorePodRequest,
                                      cri_pb2.RestorePodResponse, "restore"),
        })

    def _agent_handler(self):
        return grpc.method_handlers_generic_handler(AGENT, {
            "Snapshot": self._unary("Snapshot", self.snapshot, agent_pb2.SnapshotRequest, agent_pb2.SnapshotResponse,
                                    "snapshot"),
            "Restore": self._unary("Restore", self.restore, agent_pb2.RestoreRequest, agent_pb2.RestoreResponse,
                                   "restore"),
            "List": self._unary("List", self.list, agent_pb2.ListRequest, agent_pb2.ListResponse),
            "Status": self._unary("Status", self.status, agent_pb2.StatusRequest, agent_pb2.StatusResponse),
        })

    def _deadline(self, timeout: int, context: grpc.ServicerContext, what: str) -> Deadline:
        return Deadline.start(timeout, self.config.default_timeout_s, context.time_remaining(), what)

    def _count_failure(self, counted: str, result: str) -> None:
        if counted == "restore":
            self.metrics.restores.labels(result).inc()
        else:
            self._count_checkpoint(counted, result)

    def _measure_checkpoint(self, kind: str, run) -> list[CheckpointResult]:
        t = time.perf_counter()
        results = run()
        self._count_checkpoint(kind, "ok")
        self.metrics.checkpoint_seconds.labels(kind).observe(time.perf_counter() - t)
        for r in results:
            self.metrics.archive_bytes.inc(r.archive_bytes)
            self.metrics.snapshot_bytes_written.inc(r.bytes_written)
            self.metrics.snapshot_bytes_deduplicated.inc(r.bytes_deduplicated)
        return results

    def _count_checkpoint(self, kind: str, result: str) -> None:
        self.metrics.checkpoints.labels(kind, result).inc()

    def _measure_restore(self, run):
        t = time.perf_counter()
        out = run()
        self.metrics.restores.labels("ok").inc()
        self.metrics.restore_seconds.observe(time.perf_counter() - t)
        return out

    # --- CRI ----------------------------------------------------------------------------------------

    def checkpoint_container(self, req, context):
        """The kubelet's checkpoint: CRIU dump (the container keeps running) + archive at ``location``."""
        cid = check_name(req.container_id)
        location = confine(req.location, self.config.checkpoint_dir)
        deadline = self._deadline(req.timeout, context, f"checkpoint of container {cid!r}")

        def run():
            target = self.resolver.container(cid, max(0.1, deadline.remaining()))
            return self.checkpointer.checkpoint([target], [location], deadline, leave_running=True,
                                                kind="container")

        self._measure_checkpoint("container", run)
        return cri_pb2.CheckpointContainerResponse()

    def checkpoint_pod(self, req, context):
        pod_id = check_name(req.pod_sandbox_id, "pod sandbox id")
        path = confine(req.path, self.config.checkpoint_dir, suffix="")
        if req.post_checkpoint_state not in (cri_pb2.POST_CHECKPOINT_STATE_RUNNING,
                                             cri_pb2.POST_CHECKPOINT_STATE_STOPPED):
            raise InvalidRequest(f"post_checkpoint_state {req.post_checkpoint_state} is not RUNNING (0) or "
                                 "STOPPED (1)")
        deadline = self._deadline(req.timeout, context, f"checkpoint of pod {pod_id!r}")
        leave_running = req.post_checkpoint_state == cri_pb2.POST_CHECKPOINT_STATE_RUNNING

        def run():
            targets = self.resolver.pod(pod_id, max(0.1, deadline.remaining()))
            return self.checkpointer.checkpoint_pod(pod_id, targets, path, deadline, leave_running)

        self._measure_checkpoint("pod", run)
        return cri_pb2.CheckpointPodResponse()

    def restore_pod(self, req, context):
        """Restore every container of a CheckpointPod directory into the network namespace named by option
        ``podsnap.io/netns`` (or the pod config's annotation), with ``podsnap.io/restore-metadata`` (JSON)."""
        path = confine(req.path, self.config.checkpoint_dir, suffix="")
        settings = {**dict(req.config.annotations), **dict(req.options)}
        netns = checked_netns(settings.get(NETNS_OPTION))
        deadline = self._deadline(req.timeout, context, f"restore of pod {path.name!r}")
        results = self._measure_restore(
            lambda: self.checkpointer.restore_pod(path, deadline, netns, settings.get(METADATA_OPTION)))
        return cri_pb2.RestorePodResponse(pod_sandbox_id=results[0].pod_id if results else "")

    # --- podsnap.agent.v1 ---------------------------------------------------------------------------

    def snapshot(self, req, context):
        ids = [check_name(c) for c in req.container_ids]
        if not ids:
            raise InvalidRequest("container_ids is empty; name the containers (all ranks of a group) to snapshot")
        if len(set(ids)) != len(ids):
            raise InvalidRequest(f"container_ids {ids} names a container twice")
        name = check_name(req.name, "snapshot name") if req.name else new_snapshot_id().replace("snap-", "ckpt-", 1)
        deadline = self._deadline(req.timeout, context, f"snapshot {name!r}")

        def run():
            targets = [self.resolver.container(c, max(0.1, deadline.remaining())) for c in ids]
            if not req.process:
                return self.checkpointer.snapshot_engines(targets, deadline)
            locations = [self.config.checkpoint_dir / f"podsnap-{name}-{c}.tar" for c in ids]
            return self.checkpointer.checkpoint(targets, locations, deadline, leave_running=req.leave_running,
                                                kind="snapshot")

        results = self._measure_checkpoint("snapshot", run)
        return agent_pb2.SnapshotResponse(name=name, checkpoints=[
            agent_pb2.Checkpoint(container_id=r.container_id, archive=r.archive, store=r.store or "",
                                 snapshot=r.snapshot or "", pid=r.pid, image_bytes=r.image_bytes,
                                 bytes_written=r.bytes_written, bytes_deduplicated=r.bytes_deduplicated,
                                 seconds=r.seconds) for r in results])

    def restore(self, req, context):
        archive = confine(req.archive, self.config.checkpoint_dir)
        if not archive.is_file():
            raise NotFound(f"no archive {archive}; list them with `podsnap agent status --json`")
        netns = checked_netns(req.netns)
        cid = check_name(req.container_id) if req.container_id else None
        deadline = self._deadline(req.timeout, context, f"restore of {archive.name!r}")
        r = self._measure_restore(lambda: self.checkpointer.restore(archive, deadline, netns,
                                                                    req.restore_metadata or None, cid))
        return agent_pb2.RestoreResponse(pid=r.pid, container_id=r.container_id, seconds=r.seconds)

    def list(self, req, context):
        containers = [agent_pb2.ContainerEntry(container_id=e.container_id, container_name=e.container_name,
                                               pod_name=e.pod_name, namespace=e.namespace, pid=e.pid,
                                               netns=e.netns, store=e.store or "") for e in self.resolver.entries()]
        archives = []
        top = self.config.checkpoint_dir
        for path in sorted(top.glob("*.tar")) + sorted(top.glob("*/*.tar")):
            try:
                info = read_info(path)
            except PodsnapError:
                continue  # not ours (a runtime's own checkpoint)
            archives.append(agent_pb2.ArchiveEntry(path=str(path), container_id=info.container_id,
                                                   snapshot=info.snapshot or "", bytes=path.stat().st_size,
                                                   created=info.checkpointed_at))
        return agent_pb2.ListResponse(containers=containers, archives=archives)

    def status(self, req, context):
        cfg = self.config
        return agent_pb2.StatusResponse(
            version=__version__, mode=cfg.mode, socket=str(cfg.socket), checkpoint_dir=str(cfg.checkpoint_dir),
            store=cfg.store or "", in_flight=[op.describe() for op in self.checkpointer.in_flight()],
            counters=self.metrics.totals(), uptime_seconds=time.time() - self.started,
            runtime_socket=cfg.runtime_socket or "")


def checked_netns(name: str | None) -> str | None:
    """A network namespace name from a request (None when not given), checked by the CRIU driver."""
    if name:
        driver.netns_path(name)
    return name or None
