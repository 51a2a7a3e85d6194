"""Process-level checkpoint/restore with real CRIU and podsnap's CRIU plugin.

CRIU comes from deploy/install-criu.sh (CI runs it through `make test`); the
plugin is built from source by the fixture. Processes are started in real
network namespaces; every process a test starts or restores is killed by pid
at the end, also when the test fails.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time

import pytest
from pods import MAX_TOKENS, PROMPTS, LocalPod, Rank, Stream, health
from procs import kill_pid

from podsnap.client import request_json
from podsnap.comm_rebuild.discovery import RestoreMetadata
from podsnap.engine.launch import free_port
from podsnap.errors import PodsnapError


def podsnap(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "podsnap.cli", *args], capture_output=True, text=True, timeout=600)
    if check and done.returncode != 0:
        raise AssertionError(f"podsnap {' '.join(args)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return done


# --- the device-hook socket -------------------------------------------------------------------


def test_hook_socket_is_private_and_answers_the_protocol(hook_dir):
    from podsnap.criu_plugin.hooks import DeviceHookServer

    calls = []
    server = DeviceHookServer(lambda: calls.append("pause") or "cpu", lambda meta: calls.append(("resume", meta)))
    try:
        assert stat.S_IMODE(hook_dir.stat().st_mode) == 0o700
        assert stat.S_IMODE(server.path.stat().st_mode) == 0o600

        def ask(line: str) -> str:
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(str(server.path))
                s.sendall(line.encode() + b"\n")
                s.shutdown(socket.SHUT_WR)
                return s.makefile().read()

        assert ask("pause") == "ok cpu\n"
        assert ask("resume /x/meta.json") == "ok\n"
        assert ask("explode").startswith("error unknown request 'explode'")
        assert calls == ["pause", ("resume", "/x/meta.json")]
        assert server.events.snapshot() == ["pause", "resume"]
    finally:
        server.close()
    assert not server.path.exists()


def test_doctor_reports_a_working_setup(criu):
    report = json.loads(podsnap("doctor", "--json").stdout)
    by_name = {c["name"]: c for c in report}
    assert {"criu version", "criu check", "criu plugin", "checkpointctl", "network namespaces"} <= set(by_name)
    assert all(c["ok"] for c in report), report


# --- process checkpoints of serving engines -----------------------------------------------------


def perf_event_fd() -> int:
    """A perf event file descriptor: something CRIU cannot dump."""
    attr = ctypes.create_string_buffer(128)
    ctypes.memmove(attr, (ctypes.c_uint32 * 2)(1, 128), 8)  # PERF_TYPE_SOFTWARE, sizeof(attr)
    fd = ctypes.CDLL(None, use_errno=True).syscall(298, attr, 0, -1, -1, 0)
    if fd < 0:
        reason = f"perf_event_open is not allowed here (errno {ctypes.get_errno()})"
        if os.environ.get("CI"):
            pytest.fail(reason)
        print(reason)
        pytest.skip(reason)
    return fd


def test_a_failed_dump_leaves_the_engine_serving_and_quotes_criu(criu, hook_dir, model_factory, tmp_path):
    """The engine holds a perf event fd: CRIU aborts the dump after the plugin paused the engine; the
    engine resumes and serves the same tokens, and the error quotes CRIU's log line."""
    model, store = model_factory("llama"), tmp_path / "store"
    fd = perf_event_fd()
    pod = LocalPod(free_port())
    rank = Rank(pod, 0, None, "--model", str(model), "--store", str(store), "--master", f"127.0.0.1:{free_port()}",
                world=1, log_dir=tmp_path, pass_fds=(fd,))
    os.close(fd)
    try:
        url = rank.wait_serving().replace(":8000", f":{pod.port}")
        body = {"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS}
        before = request_json(f"{url}/v1/completions", body)[1]["choices"][0]["token_ids"]
        done = podsnap("checkpoint", "--pid", str(rank.pid), "--store", str(store), "--name", "bad", check=False)
        assert done.returncode == 2, done.stderr  # errors exit 2, with "error: ..."
        assert "criu dump failed: Error (criu/files-ext.c" in done.stderr and "perf_event" in done.stderr
        assert "dump.log" in done.stderr  # the log is named
        rank.wait_for("resumed in")
        assert request_json(f"{url}/v1/completions", body)[1]["choices"][0]["token_ids"] == before
        assert health(url)["process_checkpoints"]["device_hooks"] == ["pause", "resume"]
    finally:
        rank.kill()


def test_a_pause_during_the_previous_resume_waits_for_it_and_pauses_anew(hook_dir, model_factory, tmp_path):
    """A dump right after a --leave-running one: its pause arrives while the engine is still mapping its
    tensors back. The pause must wait for that resume and pause anew (a new snapshot); answering for the old
    pause would let CRIU dump the engine while it refills its tensors. Driven through the hook socket with
    the plugin's own requests, back to back, so the second pause always lands during the resume."""
    from podsnap.criu_plugin.driver import parse_answer
    from podsnap.criu_plugin.hooks import send_request

    model, store = model_factory("llama"), tmp_path / "store"
    pod = LocalPod(free_port())
    rank = Rank(pod, 0, None, "--model", str(model), "--store", str(store), "--master", f"127.0.0.1:{free_port()}",
                world=1, log_dir=tmp_path)
    try:
        url = rank.wait_serving().replace(":8000", f":{pod.port}")
        body = {"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS}
        before = request_json(f"{url}/v1/completions", body)[1]["choices"][0]["token_ids"]
        first = send_request(rank.pid, "pause")
        send_request(rank.pid, "resume -", wait_reply=False)
        second = send_request(rank.pid, "pause")
        assert first.startswith("ok cpu") and second.startswith("ok cpu"), (first, second)
        assert parse_answer(first)["snapshot"] != parse_answer(second)["snapshot"], (first, second)
        assert sum("paused for a process checkpoint" in line for line in rank.lines) == 2
        send_request(rank.pid, "resume -", wait_reply=False)
        deadline = time.monotonic() + 120
        while sum("resumed in" in line for line in rank.lines) < 2:
            assert time.monotonic() < deadline, "".join(rank.lines[-20:])
            time.sleep(0.05)
        assert request_json(f"{url}/v1/completions", body)[1]["choices"][0]["token_ids"] == before
    finally:
        rank.kill()


def test_tp2_group_is_checkpointed_and_restored_into_new_pods(criu, hook_dir, pod_network, tp2_snapshot, tmp_path):
    """Rank 0 in pod a, rank 1 in pod b, serving a request stream; `podsnap checkpoint` dumps both
    through the plugin (they end), `podsnap restore-process` restores rank 0 into pod c and rank 1
    into pod d (new IPs, new master); the group rebuilds and every request is answered with the
    tokens of an uninterrupted run."""
    store, expected = tp2_snapshot
    a, b, c, d = (pod_network.add(n) for n in "abcd")
    master = f"{a.ip}:29500"
    ranks = [Rank(a, 0, store, "--master", master, "--store", str(store), log_dir=tmp_path),
             Rank(b, 1, store, "--master", master, "--store", str(store), log_dir=tmp_path)]
    restored: list[int] = []
    try:
        stream = Stream([ranks[0].wait_serving()])
        stream.wait_answered(3)
        out = json.loads(podsnap("checkpoint", "--pid", str(ranks[0].pid), "--pid", str(ranks[1].pid),
                                 "--store", str(store), "--name", "cp1", "--json").stdout)
        for r in ranks:
            assert r.proc.wait(30) == -signal.SIGKILL  # CRIU ended them after the dump
        images = {p["engine"]["rank"]: p for p in out["processes"]}
        assert set(images) == {"0", "1"} and all(p["engine"]["device"] == "cpu" for p in images.values())

        meta = tmp_path / "restore.json"  # what the controller writes for the new pods
        RestoreMetadata(3, c.ip, 29500, {0: c.ip, 1: d.ip}).write(meta)
        for rank, pod in ((0, c), (1, d)):
            res = json.loads(podsnap("restore-process", "--store", str(store), "--checkpoint", "cp1",
                                     "--rank", str(rank), "--netns", pod.netns, "--restore-metadata", str(meta),
                                     "--json").stdout)
            restored.append(res["pid"])
            assert res["pid"] == ranks[rank].pid  # CRIU restores the pid
        new_url = f"http://{c.ip}:8000"
        stream.endpoints.append(new_url)  # the Service now points at the new pod
        assert stream.finish() == expected

        h = health(new_url)
        assert h["generation"] == 3 and h["active"] == [True, True]
        hooks = h["process_checkpoints"]
        assert hooks["device_hooks"] == ["pause", "resume"]
        assert hooks["suspensions"][0]["resumed_from"] == str(meta.resolve())
        assert hooks["suspensions"][0]["freed_bytes"] > 0
        for rank in (0, 1):  # the events came from CRIU's plugin, as CRIU's own logs show
            pid = ranks[rank].pid
            images_dir = store / "processes" / "cp1" / f"pid-{pid}"
            assert f"podsnap: engine {pid}: paused (ok cpu rank={rank}" in (images_dir / "dump.log").read_text()
            assert f"podsnap: engine {pid}: told to resume (metadata {meta.resolve()})" in \
                (images_dir / "restore.log").read_text()
            assert stat.S_IMODE(images_dir.stat().st_mode) == 0o700
        ranks[1].wait_for(f"rejoined generation 3 at {c.ip}:29500")
    finally:
        for r in ranks:
            if r.proc.poll() is None:
                r.kill()
        for pid in restored:
            kill_pid(pid)
        for r in ranks:
            print(f"--- rank in pod {r.pod.name}:\n" + "".join(r.lines[-30:]))


def test_restore_process_refuses_bad_names(tmp_path):
    from podsnap.snapshot.store import Store

    store = tmp_path / "store"
    Store(store)
    done = podsnap("restore-process", "--store", str(store), "--checkpoint", "../../etc", check=False)
    assert done.returncode == 2 and "not valid" in done.stderr
    done = podsnap("restore-process", "--store", str(store), "--checkpoint", "nope", check=False)
    assert done.returncode == 2 and "no process checkpoint" in done.stderr
    from podsnap.criu_plugin.driver import netns_path

    for bad in ("../x", "a/b", "", "-n"):
        with pytest.raises(PodsnapError, match="not a network namespace name"):
            netns_path(bad)
    with pytest.raises(PodsnapError, match="does not exist"):
        netns_path("podsnap-no-such-ns")
