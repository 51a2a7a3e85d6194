"""``podsnap agent serve|status``: the node's snapshot agent (CRI-compatible gRPC server) and a status client."""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path

import click

from podsnap.errors import PodsnapError


def _cli():
    from podsnap import cli

    return cli


SOCKET = click.option("--socket", "socket_path", type=click.Path(dir_okay=False, path_type=Path),
                      default="/run/podsnap/agent.sock", show_default=True,
                      help="The agent's Unix socket (point the kubelet's --container-runtime-endpoint here in "
                           "proxy mode).")


def parse_mode(value: str) -> int:
    try:
        mode = int(value, 8)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not an octal mode; use 0600 or 0660") from None
    if mode not in (0o600, 0o660):
        raise click.BadParameter(f"{value!r}: the socket must be 0600 (owner only) or 0660 (owner and group)")
    return mode


@click.group()
def agent():
    """The snapshot agent: CRI checkpoint/restore for podsnap engines on this node.

    \b
    Standalone (development): podsnap agent serve --checkpoint-dir DIR --store S
        pods register with `podsnap serve ... --container-id ID --pod-name POD`
    Kubelet proxy:            podsnap agent serve --runtime-socket /run/containerd/containerd.sock
        and start the kubelet with --container-runtime-endpoint unix:///run/podsnap/agent.sock;
        CheckpointContainer/CheckpointPod/RestorePod are handled here, every other CRI call is
        forwarded to the runtime unchanged.
    """


@agent.command()
@SOCKET
@click.option("--checkpoint-dir", type=click.Path(file_okay=False, path_type=Path),
              default="/var/lib/kubelet/checkpoints", show_default=True,
              help="Archives are written only under this directory (the kubelet's checkpoint directory).")
@click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path), default="/run/podsnap/agent",
              show_default=True, help="Private working directory (gRPC's own socket, CRIU images in progress).")
@click.option("--store", default=None, help="Snapshot store of engines whose registration names none.")
@click.option("--runtime-socket", default=None,
              help="Proxy mode: the real runtime's CRI socket (containerd, CRI-O). Without it: standalone mode.")
@click.option("--registry-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Standalone mode: where `podsnap serve --container-id` registers "
                   "[default: $PODSNAP_AGENT_REGISTRY or /run/podsnap/agent/registry].")
@click.option("--socket-mode", default="0600", show_default=True, help="0600, or 0660 with --socket-group.")
@click.option("--socket-group", type=int, default=None, help="Group id owning the socket (with --socket-mode 0660).")
@click.option("--allow-uid", "allow_uids", type=int, multiple=True,
              help="Also accept callers with this uid (root and the agent's user always are); checked with "
                   "SO_PEERCRED on every connection.")
@click.option("--allow-gid", "allow_gids", type=int, multiple=True, help="Also accept callers with this gid.")
@click.option("--default-timeout", type=click.FloatRange(min=1), default=300, show_default=True,
              help="Seconds a checkpoint or restore may take when the request's timeout is 0.")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None,
              help="Serve Prometheus metrics on this port (separate from the CRI socket).")
def serve(socket_path, checkpoint_dir, state_dir, store, runtime_socket, registry_dir, socket_mode, socket_group,
          allow_uids, allow_gids, default_timeout, metrics_port):
    """Run the agent until SIGTERM/SIGINT.

    Serves CRI runtime.v1 CheckpointContainer (a CRIU dump through podsnap's
    plugin, the container keeps running; the archive at the kubelet's location
    holds checkpoint/, config.dump, spec.dump, stats-dump, dump.log and
    podsnap.json, which references the engine snapshot in the store instead
    of device memory), CheckpointPod/RestorePod (KEP-5823; restore options
    podsnap.io/netns and podsnap.io/restore-metadata), and podsnap's own
    Snapshot/Restore/List/Status.
    """
    from podsnap.snapshot.agent import Agent, AgentConfig

    cfg = AgentConfig(socket=socket_path, checkpoint_dir=checkpoint_dir, state_dir=state_dir, store=store,
                      runtime_socket=runtime_socket, registry_dir=registry_dir, socket_mode=parse_mode(socket_mode),
                      socket_group=socket_group, allow_uids=frozenset(allow_uids), allow_gids=frozenset(allow_gids),
                      default_timeout_s=default_timeout, metrics_port=metrics_port)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    running = Agent(cfg).start()
    try:
        stop.wait()
    finally:
        running.stop()


@agent.command()
@SOCKET
@click.option("--timeout", type=float, default=10, show_default=True, help="Seconds to wait for the agent.")
@click.option("--json", "as_json", is_flag=True, help="Print status and lists as one JSON object.")
def status(socket_path, timeout, as_json):
    """Ask a running agent for its mode, counters, operations in flight, containers and archives."""
    import grpc
    from google.protobuf.json_format import MessageToDict

    from podsnap.snapshot.client import AgentClient

    try:
        with AgentClient(socket_path) as client:
            st = client.status(timeout)
            listed = client.list(timeout)
    except grpc.RpcError as e:
        raise PodsnapError(f"the agent at {socket_path} did not answer ({e.code().name}: {e.details()}); "
                           "is `podsnap agent serve` running, and may this user connect?") from None
    out = {"status": MessageToDict(st, preserving_proto_field_name=True),
           **MessageToDict(listed, preserving_proto_field_name=True)}
    if as_json:
        click.echo(json.dumps(out))
        return
    cli = _cli()
    cli.print_table(f"podsnap agent ({st.mode}) on {st.socket}", ["key", "value"],
                    [["checkpoint dir", st.checkpoint_dir], ["store", st.store or "-"],
                     ["runtime", st.runtime_socket or "-"], ["uptime", f"{st.uptime_seconds:.0f} s"],
                     *[[k, v] for k, v in sorted(st.counters.items())],
                     *[["in flight", op] for op in st.in_flight]])
    cli.print_table("containers", ["id", "pod", "namespace", "pid", "store"],
                    [[c.container_id, c.pod_name, c.namespace, c.pid, c.store] for c in listed.containers])
    cli.print_table("archives", ["path", "container", "snapshot", "MiB"],
                    [[a.path, a.container_id, a.snapshot, f"{a.bytes / 2**20:.1f}"] for a in listed.archives])
