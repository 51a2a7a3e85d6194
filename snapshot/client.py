"""A small client of the agent's socket: typed calls for the CLI, the controller and tests."""

from __future__ import annotations

from pathlib import Path

import grpc

from .rpc import agent_pb2, agent_pb2_grpc, cri_pb2, cri_pb2_grpc


class AgentClient:
    def __init__(self, socket_path: str | Path):
        self.channel = grpc.insecure_channel(f"unix://{socket_path}")
        self.cri = cri_pb2_grpc.RuntimeServiceStub(self.channel)
        self.agent = agent_pb2_grpc.AgentStub(self.channel)

    def __enter__(self) -> AgentClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def checkpoint_container(self, container_id: str, location: str, timeout: int = 0,
                             deadline_s: float | None = None) -> None:
        self.cri.CheckpointContainer(cri_pb2.CheckpointContainerRequest(container_id=container_id,
                                                                        location=location, timeout=timeout),
                                     timeout=deadline_s)

    def status(self, deadline_s: float | None = 10) -> agent_pb2.StatusResponse:
        return self.agent.Status(agent_pb2.StatusRequest(), timeout=deadline_s)

    def list(self, deadline_s: float | None = 10) -> agent_pb2.ListResponse:
        return self.agent.List(agent_pb2.ListRequest(), timeout=deadline_s)
