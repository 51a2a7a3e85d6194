"""Which process is container X? From the runtime's ContainerStatus (proxy mode) or the registry (standalone).

Runtimes report the container's pid in ``ContainerStatusResponse.info["info"]``,
a JSON document returned with ``verbose=true`` (containerd and CRI-O both put
``"pid"`` there; containerd also ``"sandboxID"``). Pod name and namespace come
from the standard ``io.kubernetes.pod.*`` labels.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

import grpc

from podsnap.errors import PodsnapError

from .registry import ContainerEntry, ContainerNotFound, Registry, check_name
from .rpc import cri_pb2


class RuntimeUnavailable(PodsnapError):
    pass


@dataclass(frozen=True)
class Target:
    """A container's main process, as the agent found it."""
    container_id: str
    container_name: str
    pod_name: str
    namespace: str
    pod_id: str
    pid: int
    store: str | None

    @classmethod
    def from_entry(cls, e: ContainerEntry) -> Target:
        return cls(e.container_id, e.container_name, e.pod_name, e.namespace, e.pod_name, e.pid, e.store)


class RegistryResolver:
    """Standalone mode: the registry ``podsnap serve --container-id`` writes; a pod's id is its name."""

    mode = "standalone"

    def __init__(self, registry: Registry, default_store: str | None):
        self.registry, self.default_store = registry, default_store

    def container(self, container_id: str, timeout_s: float | None = None) -> Target:
        t = Target.from_entry(self.registry.get(check_name(container_id)))
        return t if t.store else replace(t, store=self.default_store)

    def pod(self, pod_id: str, timeout_s: float | None = None) -> list[Target]:
        check_name(pod_id, "pod sandbox id")
        found = [self.container(e.container_id) for e in self.registry.entries() if e.pod_name == pod_id]
        if not found:
            raise ContainerNotFound(f"no running container of pod {pod_id!r} in the registry {self.registry.root}")
        return found

    def entries(self) -> list[ContainerEntry]:
        return self.registry.entries()


class RuntimeResolver:
    """Proxy mode: ask the real runtime (ContainerStatus with verbose=true, ListContainers)."""

    mode = "proxy"

    def __init__(self, channel: grpc.Channel, default_store: str | None):
        self.channel, self.default_store = channel, default_store

    def _call(self, method: str, request, response_type, timeout_s):
        rpc = self.channel.unary_unary(f"/runtime.v1.RuntimeService/{method}",
                                       request_serializer=lambda m: m.SerializeToString(),
                                       response_deserializer=response_type.FromString)
        try:
            return rpc(request, timeout=timeout_s)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                raise ContainerNotFound(f"the container runtime does not know it: {e.details()}") from None
            raise RuntimeUnavailable(f"the container runtime did not answer {method} ({e.code().name}: "
                                     f"{e.details()})") from None

    def container(self, container_id: str, timeout_s: float | None = None) -> Target:
        check_name(container_id)
        resp = self._call("ContainerStatus", cri_pb2.ContainerStatusRequest(container_id=container_id, verbose=True),
                          cri_pb2.ContainerStatusResponse, timeout_s)
        return target_from_status(container_id, resp, self.default_store)

    def pod(self, pod_id: str, timeout_s: float | None = None) -> list[Target]:
        check_name(pod_id, "pod sandbox id")
        req = cri_pb2.ListContainersRequest(filter=cri_pb2.ContainerFilter(pod_sandbox_id=pod_id))
        listed = self._call("ListContainers", req, cri_pb2.ListContainersResponse, timeout_s).containers
        running = [c.id for c in listed if c.state == cri_pb2.CONTAINER_RUNNING]
        if not running:
            raise ContainerNotFound(f"pod sandbox {pod_id!r} has no running container")
        return [self.container(c, timeout_s) for c in running]

    def entries(self) -> list[ContainerEntry]:
        return []


def target_from_status(container_id: str, resp, default_store: str | None) -> Target:
    status = resp.status
    if status.state != cri_pb2.CONTAINER_RUNNING:
        raise ContainerNotFound(f"container {container_id!r} is not running (state "
                                f"{cri_pb2.ContainerState.Name(status.state)})")
    try:
        info = json.loads(resp.info.get("info", "{}"))
        pid = int(info["pid"])
    except (ValueError, KeyError, TypeError):
        raise RuntimeUnavailable(f"the runtime's ContainerStatus of {container_id!r} names no pid in "
                                 "info[\"info\"] (asked with verbose=true)") from None
    labels = status.labels
    return Target(container_id, status.metadata.name or container_id, labels.get("io.kubernetes.pod.name", ""),
                  labels.get("io.kubernetes.pod.namespace", ""), str(info.get("sandboxID", "")), pid,
                  status.annotations.get("podsnap.io/store") or default_store)
