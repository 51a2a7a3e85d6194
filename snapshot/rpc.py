"""The agent's generated gRPC modules (CRI ``runtime.v1`` and ``podsnap.agent.v1``), generated if missing.

Import the message and stub modules from here, never from ``.gen`` directly:
this makes sure they exist and match the .proto files first.
"""

from __future__ import annotations

from . import protogen

protogen.ensure()

from .gen import agent_pb2, agent_pb2_grpc, cri_pb2, cri_pb2_grpc  # noqa: E402

CRI_RUNTIME = "runtime.v1.RuntimeService"
CRI_IMAGE = "runtime.v1.ImageService"
AGENT = "podsnap.agent.v1.Agent"

__all__ = ["AGENT", "CRI_IMAGE", "CRI_RUNTIME", "agent_pb2", "agent_pb2_grpc", "cri_pb2", "cri_pb2_grpc"]
