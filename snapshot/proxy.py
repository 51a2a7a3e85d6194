"""Proxy mode: every CRI call the agent does not handle goes to the real runtime, unchanged.

A ``grpc.GenericRpcHandler`` answers any method of ``runtime.v1.RuntimeService``
and ``runtime.v1.ImageService`` with a stream-stream handler whose
(de)serializers are the identity: request messages are forwarded to the
runtime socket as the bytes that arrived, and the runtime's response
messages, status code, details and trailing metadata come back the same way.
gRPC's wire format does not depend on a method's arity, so one handler
serves unary calls and server-streaming ones (``GetContainerEvents``) alike;
there is no per-method code. The caller's deadline and metadata are passed
on; a cancelled caller cancels the upstream call.
"""

from __future__ import annotations

import grpc

FORWARDED_SERVICES = ("runtime.v1.RuntimeService", "runtime.v1.ImageService")
DROPPED_METADATA = ("user-agent", "grpc-", ":")
MESSAGE_LIMITS = [("grpc.max_receive_message_length", 64 << 20),  # CRI lists (ListContainers, ListImages)
                  ("grpc.max_send_message_length", 64 << 20)]    # can pass gRPC's 4 MiB default


def identity(data: bytes) -> bytes:
    return data


def runtime_channel(target: str) -> grpc.Channel:
    """A channel to the runtime: ``unix:///run/containerd/containerd.sock`` or a bare socket path."""
    if "://" not in target and not target.startswith("unix:"):
        target = f"unix://{target}"
    return grpc.insecure_channel(target, options=MESSAGE_LIMITS)


class PassthroughHandler(grpc.GenericRpcHandler):
    """Forwards the CRI services' methods that no registered handler took to ``channel``."""

    def __init__(self, channel: grpc.Channel, services: tuple[str, ...] = FORWARDED_SERVICES):
        self.channel = channel
        self.prefixes = tuple(f"/{s}/" for s in services)

    def service(self, handler_call_details):
        method = handler_call_details.method
        if not method.startswith(self.prefixes):
            return None
        return grpc.stream_stream_rpc_method_handler(
            lambda requests, context: self._forward(method, requests, context),
            request_deserializer=identity, response_serializer=identity)

    def _forward(self, method: str, requests, context: grpc.ServicerContext):
        call = self.channel.stream_stream(method, request_serializer=identity, response_deserializer=identity)(
            requests, timeout=context.time_remaining(),
            metadata=[(k, v) for k, v in context.invocation_metadata() if not k.startswith(DROPPED_METADATA)])
        context.add_callback(call.cancel)
        try:
            yield from call
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.CANCELLED and not context.is_active():
                return
            context.set_trailing_metadata(tuple(e.trailing_metadata() or ()))
            details = e.details() or ""
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                details = f"the container runtime is unavailable through the podsnap agent: {details}"
            context.abort(e.code(), details)
        trailing = call.trailing_metadata()
        if trailing:
            context.set_trailing_metadata(tuple(trailing))
