"""The snapshot agent, driven by real gRPC clients over its Unix socket.

Real parts throughout: grpcio servers and clients on Unix sockets, CRIU with
podsnap's plugin, network namespaces (pod_network), `podsnap serve` pods and
the real `checkpointctl`. Every process a test starts or restores is killed by
pid at the end, also when the test fails. No test measures wall-clock time:
concurrency is observed through the engines' hook events and the agent's
Status.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path

import grpc
import pytest
from agent_helpers import FakeRuntime, RunningAgent, SlowEngine, files_under, in_thread, short_dir, wait_until
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pods import MAX_TOKENS, PROMPTS, Rank
from procs import kill_pid

from podsnap.client import request_json
from podsnap.comm_rebuild.discovery import RestoreMetadata
from podsnap.engine.launch import free_port
from podsnap.snapshot import protogen
from podsnap.snapshot.proxy import identity
from podsnap.snapshot.rpc import agent_pb2, cri_pb2

CODE = grpc.StatusCode


@pytest.fixture
def agent_env(hook_dir, monkeypatch):
    """Short private directories: the agent's sockets and state, the registry, the checkpoint directory."""
    base = short_dir("psa")
    monkeypatch.setenv("PODSNAP_AGENT_REGISTRY", str(base / "registry"))
    (base / "checkpoints").mkdir(mode=0o700)
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def agent(agent_env):
    running = RunningAgent(agent_env, agent_env / "checkpoints")
    yield running
    running.stop()


def cri_error(call, *args, **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call(*args, **kwargs)
    return e.value


# --- stubs, socket security ------------------------------------------------------------------


def test_stubs_are_generated_and_keyed_on_the_protos(tmp_path):
    assert protogen.is_fresh()
    out = protogen.generate(tmp_path / "gen")
    assert {"cri_pb2.py", "cri_pb2_grpc.py", "agent_pb2.py", "agent_pb2_grpc.py", "STAMP"} <= set(os.listdir(out))
    assert (out / "STAMP").read_text() == protogen.wanted_stamp()
    assert "from . import cri_pb2" in (out / "cri_pb2_grpc.py").read_text()
    fields = {f.name: f.number for f in cri_pb2.CheckpointContainerRequest.DESCRIPTOR.fields}
    assert fields == {"container_id": 1, "location": 2, "timeout": 3}
    assert cri_pb2.DESCRIPTOR.services_by_name["RuntimeService"].full_name == "runtime.v1.RuntimeService"
    pod = {f.name: f.number for f in cri_pb2.CheckpointPodRequest.DESCRIPTOR.fields}
    assert pod == {"pod_sandbox_id": 1, "path": 2, "timeout": 3, "options": 4, "post_checkpoint_state": 5}


H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])  # + empty SETTINGS


def probe_as(socket_path: Path, uid: int, gid: int) -> str:
    """Connect from a child process running as ``uid``/``gid`` (it drops root before connecting) and tell
    whether the gRPC server answered the HTTP/2 preface or the connection was closed."""
    import socket

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: raw sockets only, then _exit
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(str(socket_path))
                s.sendall(H2_PREFACE)
                s.settimeout(30)
                os.write(w, b"answered" if s.recv(64) else b"closed")
        except (ConnectionResetError, BrokenPipeError):
            os.write(w, b"closed")
        except OSError as e:
            os.write(w, f"error {e}".encode())
        os._exit(0)
    os.close(w)
    try:
        return os.read(r, 200).decode()
    finally:
        os.close(r)
        os.waitpid(pid, 0)


def test_socket_is_private_and_peercred_refuses_other_users(agent_env):
    nobody, group = 65534, 65533
    os.chmod(agent_env, 0o755)  # let the other user reach the socket: only SO_PEERCRED stands in the way
    running = RunningAgent(agent_env, agent_env / "checkpoints", socket_mode=0o660, socket_group=group)
    try:
        sock = running.config.socket
        assert stat.S_IMODE(sock.stat().st_mode) == 0o660 and sock.stat().st_gid == group
        assert stat.S_IMODE(running.config.private_socket.parent.stat().st_mode) == 0o700
        assert probe_as(sock, nobody, group) == "closed"
        assert running.client.status().counters["refused_connections"] == 1
        assert running.client.status().mode == "standalone"  # root is allowed
    finally:
        running.stop()
    allowed = RunningAgent(agent_env, agent_env / "checkpoints", socket_mode=0o660, socket_group=group,
                           allow_uids=frozenset({nobody}))
    try:
        assert probe_as(allowed.config.socket, nobody, group) == "answered"
    finally:
        allowed.stop()
    assert not allowed.config.socket.exists()


def test_socket_mode_other_than_0600_or_0660_is_refused(agent_env):
    from podsnap.errors import PodsnapError

    with pytest.raises(PodsnapError, match="0600"):
        RunningAgent(agent_env, agent_env / "checkpoints", socket_mode=0o666)


# --- bad input --------------------------------------------------------------------------------


def test_bad_requests_get_their_status_code_and_leave_no_file(agent, agent_env, tmp_path):
    cdir = agent_env / "checkpoints"
    (cdir / "escape").symlink_to(tmp_path)
    cri, api = agent.client.cri, agent.client.agent
    good = str(cdir / "checkpoint-p_ns-c-2025-01-01T00:00:00Z.tar")
    cases = [
        (cri.CheckpointContainer, cri_pb2.CheckpointContainerRequest(container_id="../etc", location=good),
         CODE.INVALID_ARGUMENT, "container id '../etc' is not valid"),
        (cri.CheckpointContainer, cri_pb2.CheckpointContainerRequest(container_id="a/b", location=good),
         CODE.INVALID_ARGUMENT, "no '/'"),
        (cri.CheckpointContainer, cri_pb2.CheckpointContainerRequest(container_id="", location=good),
         CODE.INVALID_ARGUMENT, "container id '' is not valid"),
        (cri.CheckpointContainer, cri_pb2.CheckpointContainerRequest(container_id="c1", location="/tmp/x.tar"),
         CODE.INVALID_ARGUMENT, "outside the checkpoint directory"),
        (cri.CheckpointContainer, cri_pb2.CheckpointContainerRequest(container_id="c1",
                                                                     location=str(cdir / "escape" / "x.tar")),
         CODE.INVALID_ARGUMENT, "outside the checkpoint directory"),
        (cri.CheckpointContainer, cri_pb2.CheckpointContainerRequest(container_id="c1",
                                                                     location=str(cdir / ".." / "x.tar")),
         CODE.INVALID_ARGUMENT, "outside the checkpoint directory"),
        (cri.CheckpointContainer, cri_pb2.CheckpointContainerRequest(container_id="c1", location=str(cdir / "x.zip")),
         CODE.INVALID_ARGUMENT, "must end in a file name ending in .tar"),
        (cri.CheckpointContainer, cri_pb2.CheckpointContainerRequest(container_id="c1", location="x.tar"),
         CODE.INVALID_ARGUMENT, "not an absolute path"),
        (cri.CheckpointContainer, cri_pb2.CheckpointContainerRequest(container_id="c1", location=good, timeout=-1),
         CODE.INVALID_ARGUMENT, "timeout -1 is negative"),
        (cri.CheckpointContainer, cri_pb2.CheckpointContainerRequest(container_id="nope", location=good),
         CODE.NOT_FOUND, "no running container 'nope'"),
        (cri.CheckpointPod, cri_pb2.CheckpointPodRequest(pod_sandbox_id="p/../q", path=str(cdir / "pod")),
         CODE.INVALID_ARGUMENT, "pod sandbox id"),
        (cri.CheckpointPod, cri_pb2.CheckpointPodRequest(pod_sandbox_id="nopod", path=str(cdir / "pod")),
         CODE.NOT_FOUND, "no running container of pod 'nopod'"),
        (cri.RestorePod, cri_pb2.RestorePodRequest(path=str(cdir / "missing")), CODE.NOT_FOUND, "no pod checkpoint"),
        (cri.RestorePod, cri_pb2.RestorePodRequest(path=str(cdir / "p"), options={"podsnap.io/netns": "../x"}),
         CODE.INVALID_ARGUMENT, "not a name from `ip netns list`"),
        (cri.RestorePod, cri_pb2.RestorePodRequest(path=str(cdir / "p"), options={"podsnap.io/netns": "no-such-ns"}),
         CODE.NOT_FOUND, "does not exist"),
        (api.Restore, agent_pb2.RestoreRequest(archive=str(cdir / "none.tar")), CODE.NOT_FOUND, "no archive"),
        (api.Restore, agent_pb2.RestoreRequest(archive="/etc/passwd.tar"), CODE.INVALID_ARGUMENT, "outside"),
        (api.Snapshot, agent_pb2.SnapshotRequest(), CODE.INVALID_ARGUMENT, "container_ids is empty"),
        (api.Snapshot, agent_pb2.SnapshotRequest(container_ids=["a", "a"]), CODE.INVALID_ARGUMENT, "twice"),
        (api.Snapshot, agent_pb2.SnapshotRequest(container_ids=["a"], name="../n"), CODE.INVALID_ARGUMENT,
         "snapshot name"),
    ]
    for call, request, code, message in cases:
        err = cri_error(call, request, timeout=30)
        assert err.code() == code and message in err.details(), (request, err.code(), err.details())
    assert files_under(cdir) == ["escape"] and files_under(tmp_path) == []
    assert agent.client.status().counters["checkpoints_invalid_argument"] >= 9
    unimplemented = cri_error(agent.client.cri.Version, cri_pb2.VersionRequest(), timeout=30)
    assert unimplemented.code() == CODE.UNIMPLEMENTED  # standalone mode forwards nothing


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(container_id=st.text(max_size=40), location=st.one_of(st.text(max_size=60), st.just("/")),
       timeout=st.integers(-2**63, 2**63 - 1), pod=st.text(max_size=20), netns=st.text(max_size=20))
def test_fuzzed_requests_are_refused_and_the_agent_stays_up(agent, agent_env, container_id, location, timeout, pod,
                                                            netns):
    cdir = agent_env / "checkpoints"
    allowed = {CODE.INVALID_ARGUMENT, CODE.NOT_FOUND}
    for loc in (location, str(cdir / location)):
        err = cri_error(agent.client.cri.CheckpointContainer,
                        cri_pb2.CheckpointContainerRequest(container_id=container_id, location=loc, timeout=timeout),
                        timeout=30)
        assert err.code() in allowed, err.details()
    err = cri_error(agent.client.cri.CheckpointPod,
                    cri_pb2.CheckpointPodRequest(pod_sandbox_id=pod, path=str(cdir / location), timeout=timeout),
                    timeout=30)
    assert err.code() in allowed | {CODE.ALREADY_EXISTS}, err.details()
    err = cri_error(agent.client.cri.RestorePod, cri_pb2.RestorePodRequest(
        path=str(cdir / location), options={"podsnap.io/netns": netns}), timeout=30)
    assert err.code() in allowed, err.details()
    assert files_under(cdir) == []
    assert agent.client.status().in_flight == []


# --- proxy mode -------------------------------------------------------------------------------


def test_proxy_forwards_other_calls_byte_identical(agent_env):
    runtime = FakeRuntime(agent_env / "runtime.sock", pids={"c-live": os.getpid()}).start()
    runtime.events = [cri_pb2.ContainerEventResponse(container_id=f"c{i}", created_at=i).SerializeToString()
                      for i in range(3)]
    agent = RunningAgent(agent_env, agent_env / "checkpoints", runtime_socket=str(runtime.socket))
    try:
        channel = agent.client.channel
        requests = {
            "/runtime.v1.RuntimeService/Version": cri_pb2.VersionRequest(version="v1").SerializeToString(),
            "/runtime.v1.RuntimeService/ListContainers": cri_pb2.ListContainersRequest(
                filter=cri_pb2.ContainerFilter(pod_sandbox_id="sandbox-c-live")).SerializeToString(),
            "/runtime.v1.RuntimeService/ContainerStatus": cri_pb2.ContainerStatusRequest(
                container_id="c-live", verbose=True).SerializeToString() + b"\xa8\x06\x01",  # + an unknown field
        }
        for method, raw in requests.items():
            call = channel.unary_unary(method, request_serializer=identity, response_deserializer=identity)
            answer = call(raw, timeout=30)
            assert runtime.calls[-1].method == method and runtime.calls[-1].request == raw
            if method.endswith("Version"):
                assert answer == FakeRuntime.VERSION
            elif method.endswith("ListContainers"):
                assert answer == runtime.list_containers().SerializeToString()
            else:
                assert answer == runtime.status("c-live").SerializeToString()
        stream = channel.unary_stream("/runtime.v1.RuntimeService/GetContainerEvents", request_serializer=identity,
                                      response_deserializer=identity)
        assert list(stream(b"", timeout=30)) == runtime.events
        err = cri_error(channel.unary_unary("/runtime.v1.RuntimeService/ContainerStatus", request_serializer=identity,
                                            response_deserializer=identity),
                        cri_pb2.ContainerStatusRequest(container_id="gone").SerializeToString(), timeout=30)
        assert err.code() == CODE.NOT_FOUND and "'gone' does not exist" in err.details()
        err = cri_error(channel.unary_unary("/runtime.v1.ImageService/ListImages", request_serializer=identity,
                                            response_deserializer=identity), b"", timeout=30)
        assert err.code() == CODE.UNIMPLEMENTED and "fake runtime" in err.details()  # the runtime's own answer
        # CheckpointContainer is the agent's: it asks the runtime for the pid, the runtime never sees the call
        n = len(runtime.calls)
        err = cri_error(agent.client.cri.CheckpointContainer, cri_pb2.CheckpointContainerRequest(
            container_id="unknown", location=str(agent_env / "checkpoints" / "x.tar")), timeout=30)
        assert err.code() == CODE.NOT_FOUND and "does not know it" in err.details()
        assert [c.method for c in runtime.calls[n:]] == ["/runtime.v1.RuntimeService/ContainerStatus"]
        assert cri_pb2.ContainerStatusRequest.FromString(runtime.calls[-1].request).verbose
        runtime.stop()
        err = cri_error(agent.client.cri.Version, cri_pb2.VersionRequest(), timeout=30)
        assert err.code() == CODE.UNAVAILABLE and "runtime is unavailable" in err.details()
    finally:
        agent.stop()
        runtime.stop()


# --- timeouts and concurrency (engines that pause when the test lets them) ---------------------


def test_timeout_gives_deadline_exceeded_resumes_the_engine_and_leaves_nothing(criu, agent, agent_env):
    engine = SlowEngine("slow-1", agent_env)
    try:
        location = agent_env / "checkpoints" / "checkpoint-slow.tar"
        err = cri_error(agent.client.checkpoint_container, "slow-1", str(location), timeout=1)
        assert err.code() == CODE.DEADLINE_EXCEEDED and "timeout of 1 s" in err.details(), err.details()
        assert files_under(agent_env / "checkpoints") == []
        assert files_under(agent_env / "state" / "work") == []
        engine.allow()  # its pause ends only now; the resume it was sent is waiting on its socket
        engine.wait_events(["ready", "pause", "resume"])
        assert engine.proc.poll() is None
        # the gRPC call's own deadline is honoured too
        engine.release.unlink()
        err = cri_error(agent.client.checkpoint_container, "slow-1", str(location), timeout=0, deadline_s=1.5)
        assert err.code() == CODE.DEADLINE_EXCEEDED
        engine.allow()
        engine.wait_events(["ready", "pause", "resume", "pause", "resume"])
        wait_until(lambda: agent.in_flight() == [], "the agent has finished the cut-off request")
        assert files_under(agent_env / "checkpoints") == []
        metrics = agent.agent.metrics.checkpoints.labels("container", "deadline_exceeded")._value.get()
        assert metrics == 2
    finally:
        kill_pid(engine.pid)


def test_requests_for_one_container_wait_for_each_other_and_others_run_in_parallel(criu, agent, agent_env):
    a, b = SlowEngine("eng-a", agent_env), SlowEngine("eng-b", agent_env)
    cdir = agent_env / "checkpoints"
    try:
        first, out1 = in_thread(agent.client.checkpoint_container, "eng-a", str(cdir / "a1.tar"))
        a.wait_events(["ready", "pause"])  # the first request holds a's lock while a pauses
        second, out2 = in_thread(agent.client.checkpoint_container, "eng-a", str(cdir / "a2.tar"))
        wait_until(lambda: any("eng-a waiting for lock" in op for op in agent.in_flight()),
                   "the second request for eng-a waits for the first")
        assert a.seen() == ["ready", "pause"]  # not paused a second time while the first dump is under way
        third, out3 = in_thread(agent.client.checkpoint_container, "eng-b", str(cdir / "b1.tar"))
        b.wait_events(["ready", "pause"])  # another container proceeds while eng-a's requests are held
        assert a.seen() == ["ready", "pause"] and not a.release.exists()
        a.allow()
        b.allow()
        for t in (first, second, third):
            t.join(120)
        assert "error" not in out1 and "error" not in out2 and "error" not in out3, (out1, out2, out3)
        assert a.seen() == ["ready", "pause", "resume", "pause", "resume"]
        assert sorted(p.name for p in cdir.iterdir()) == ["a1.tar", "a2.tar", "b1.tar"]
        for p in cdir.iterdir():
            assert stat.S_IMODE(p.stat().st_mode) == 0o600
    finally:
        kill_pid(a.pid)
        kill_pid(b.pid)


# --- end to end with podsnap serve pods ---------------------------------------------------------


def checkpointctl_show(archive: Path) -> str:
    from podsnap.criu_plugin import tools

    binary = tools.checkpointctl_binary()
    assert binary is not None, "checkpointctl is not installed (deploy/install-criu.sh installs it)"
    done = subprocess.run([str(binary), "show", str(archive)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def tokens(url: str) -> list[int]:
    return request_json(f"{url}/v1/completions", {"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS},
                        timeout=60)[1]["choices"][0]["token_ids"]


def serving_url(pod, timeout_s: float = 120) -> str:
    url = f"http://{pod.ip}:8000"

    def up() -> bool:
        try:
            return request_json(f"{url}/health", timeout=5)[0] == 200
        except Exception:  # noqa: BLE001 - not up yet
            return False

    wait_until(up, f"pod {pod.name} serves", timeout_s)
    return url


def test_proxy_checkpoint_container_archive_and_restore_into_a_new_pod(criu, agent_env, pod_network, model_factory,
                                                                       tmp_path):
    """Proxy mode: the runtime (a stand-in) reports the pod's pid; CheckpointContainer dumps the serving pod,
    which keeps serving; checkpointctl reads the archive. Then podsnap's Snapshot dumps and ends the pod, and
    Restore brings its archive back in a new network namespace, answering with the same tokens."""
    model, store = model_factory("llama"), tmp_path / "store"
    a, b = pod_network.add("a"), pod_network.add("b")
    rank = Rank(a, 0, None, "--model", str(model), "--store", str(store), "--master", f"{a.ip}:{free_port()}",
                world=1, log_dir=tmp_path)
    runtime = FakeRuntime(agent_env / "runtime.sock", pids={"ctr-0": rank.pid}).start()
    agent = RunningAgent(agent_env, agent_env / "checkpoints", runtime_socket=str(runtime.socket), store=str(store),
                         metrics_port=free_port())
    restored = []
    try:
        rank.wait_serving()
        url = serving_url(a)
        before = tokens(url)
        location = agent_env / "checkpoints" / "checkpoint-pod-ctr-0_llm-engine-2025-01-01T00:00:00Z.tar"
        agent.client.checkpoint_container("ctr-0", str(location), timeout=120)
        assert stat.S_IMODE(location.stat().st_mode) == 0o600
        shown = checkpointctl_show(location)
        assert "engine" in shown and "ctr-0" in shown and "podsnap" in shown, shown
        rank.wait_for("resumed in")
        assert tokens(url) == before  # CRI semantics: the container keeps running
        with tarfile.open(location) as tar:
            names = set(tar.getnames())
            ref = json.loads(tar.extractfile("podsnap.json").read())
            pages = sum(tar.getmember(n).size for n in names if n.startswith("checkpoint/pages-"))
        assert {"config.dump", "spec.dump", "stats-dump", "dump.log", "podsnap.json",
                "checkpoint/inventory.img"} <= names
        assert ref["store"] == str(store) and ref["pid"] == rank.pid and ref["snapshot"]
        print(f"archive {location.stat().st_size} bytes, CRIU pages {pages} bytes")

        # The controller's path: podsnap's Snapshot dumps the pod and ends it (a container left running keeps
        # writing its stdout file, and CRIU restores a regular file only at the size it had when dumped).
        snap = agent.client.agent.Snapshot(agent_pb2.SnapshotRequest(container_ids=["ctr-0"], name="move-1",
                                                                     process=True), timeout=300)
        archive = Path(snap.checkpoints[0].archive)
        assert archive == agent_env / "checkpoints" / "podsnap-move-1-ctr-0.tar" and snap.checkpoints[0].snapshot
        assert rank.proc.wait(60) is not None  # CRIU ended it after the dump
        meta = RestoreMetadata(1, b.ip, free_port(), {0: b.ip}).to_json()
        res = agent.client.agent.Restore(agent_pb2.RestoreRequest(archive=str(archive), netns=b.netns,
                                                                  restore_metadata=meta), timeout=300)
        restored.append(res.pid)
        assert res.pid == rank.pid and res.container_id == "ctr-0"
        assert tokens(serving_url(b)) == before
        assert files_under(agent_env / "state" / "work") == [] and files_under(agent_env / "state" / "restores") == []

        metrics = urllib.request.urlopen(f"http://127.0.0.1:{agent.config.metrics_port}/metrics", timeout=10).read()
        text = metrics.decode()
        assert 'podsnap_agent_checkpoints_total{kind="container",result="ok"} 1.0' in text
        assert 'podsnap_agent_checkpoints_total{kind="snapshot",result="ok"} 1.0' in text
        assert 'podsnap_agent_restores_total{result="ok"} 1.0' in text
        assert "podsnap_agent_checkpoint_seconds_count" in text and "podsnap_agent_archive_bytes_total" in text
        dedup = agent.agent.metrics.snapshot_bytes_deduplicated._value.get()
        written = agent.agent.metrics.snapshot_bytes_written._value.get()
        assert written + dedup > 0
    finally:
        if rank.proc.poll() is None:
            rank.kill()
        for pid in restored:
            kill_pid(pid)
        agent.stop()
        runtime.stop()
        print("".join(rank.lines[-30:]))
        for log in (agent_env / "state" / "logs").glob("*.log"):
            print(f"--- {log}:\n" + "".join(log.read_text().splitlines(keepends=True)[-25:]))


def test_standalone_checkpoint_pod_and_restore_pod_in_a_new_network_namespace(criu, agent, agent_env, pod_network,
                                                                              model_factory, tmp_path):
    """Standalone mode: the pod registers itself; an engine-only Snapshot leaves it serving; CheckpointPod
    (STOPPED) writes the pod's directory and ends it; RestorePod brings it back in another network namespace
    with identical tokens; List and Status see it all."""
    model, store = model_factory("llama"), tmp_path / "store"
    a, c = pod_network.add("a"), pod_network.add("c")
    rank = Rank(a, 0, None, "--model", str(model), "--store", str(store), "--master", f"{a.ip}:{free_port()}",
                "--container-id", "llm-0-engine", "--pod-name", "llm-0", world=1, log_dir=tmp_path)
    restored = []
    try:
        rank.wait_serving()
        url = serving_url(a)
        before = tokens(url)
        listed = agent.client.list()
        assert [(e.container_id, e.pod_name, e.pid) for e in listed.containers] == [("llm-0-engine", "llm-0",
                                                                                     rank.pid)]
        snap = agent.client.agent.Snapshot(agent_pb2.SnapshotRequest(container_ids=["llm-0-engine"]), timeout=120)
        assert snap.checkpoints[0].snapshot and snap.checkpoints[0].archive == ""
        rank.wait_for("resumed in")
        assert tokens(url) == before

        pod_dir = agent_env / "checkpoints" / "llm-0-1"
        agent.client.cri.CheckpointPod(cri_pb2.CheckpointPodRequest(
            pod_sandbox_id="llm-0", path=str(pod_dir),
            post_checkpoint_state=cri_pb2.POST_CHECKPOINT_STATE_STOPPED), timeout=300)
        rank.proc.wait(60)  # CRIU ended it after the dump
        assert sorted(os.listdir(pod_dir)) == ["llm-0-engine.tar", "pod.json"]
        assert "llm-0-engine" in checkpointctl_show(pod_dir / "llm-0-engine.tar")

        meta = RestoreMetadata(2, c.ip, free_port(), {0: c.ip}).to_json()
        resp = agent.client.cri.RestorePod(cri_pb2.RestorePodRequest(
            path=str(pod_dir), options={"podsnap.io/netns": c.netns, "podsnap.io/restore-metadata": meta}),
            timeout=300)
        assert resp.pod_sandbox_id == "llm-0"
        entry = agent.client.list().containers[0]
        restored.append(entry.pid)
        assert entry.pid == rank.pid and entry.container_id == "llm-0-engine"
        assert entry.netns == os.readlink(f"/proc/{entry.pid}/ns/net") != os.readlink("/proc/self/ns/net")
        assert tokens(serving_url(c)) == before
        status = agent.client.status()
        assert status.counters["checkpoints_ok"] == 2 and status.counters["restores_ok"] == 1
        assert {x.container_id for x in agent.client.list().archives} == {"llm-0-engine"}
    finally:
        if rank.proc.poll() is None:
            rank.kill()
        for pid in restored:
            kill_pid(pid)
        print("".join(rank.lines[-30:]))


def test_agent_cli_status_and_help(agent):
    cli = [sys.executable, "-m", "podsnap.cli", "agent"]
    done = subprocess.run([*cli, "status", "--socket", str(agent.config.socket), "--json"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["status"]["mode"] == "standalone" and out["status"]["checkpoint_dir"].endswith("checkpoints")
    done = subprocess.run([*cli, "status", "--socket", "/tmp/no-such-agent.sock"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "did not answer" in done.stderr
    done = subprocess.run([*cli, "serve", "--help"], capture_output=True, text=True, timeout=60)
    assert "--runtime-socket" in done.stdout and "SO_PEERCRED" in done.stdout
