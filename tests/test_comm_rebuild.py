"""comm_rebuild: address discovery, the incremental port policy, teardown with a dead peer,
and TP=2 groups rebuilt for new pod IPs in real network namespaces."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from pods import MAX_TOKENS, PROMPTS, LocalPod, Rank, Stream, health
from procs import kill_tree

from podsnap.client import request_json
from podsnap.comm_rebuild import discovery, groups, rendezvous
from podsnap.comm_rebuild.discovery import RestoreMetadata
from podsnap.engine.launch import free_port, run_on_ranks
from podsnap.errors import PodsnapError

# --- address discovery ---------------------------------------------------------------


def test_metadata_file_wins_over_environment(tmp_path):
    meta = tmp_path / "restore.json"
    RestoreMetadata(3, "10.1.2.3", 31000, {0: "10.1.2.3", 1: "10.1.2.9"}).write(meta)
    env = {"POD_IP": "10.9.9.9", "MASTER_ADDR": "10.8.8.8", "MASTER_PORT": "29500"}
    a = discovery.discover(1, meta, env=env)
    assert (a.own_addr, a.master_addr, a.port_base, a.generation) == ("10.1.2.9", "10.1.2.3", 31000, 3)
    assert a.sources["master_addr"] == "metadata"


def test_environment_then_interfaces():
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    a = discovery.discover(1, None, env=env)
    assert (a.master_addr, a.port_base, a.generation) == ("127.0.0.1", 29500, 0)
    assert a.own_addr == "127.0.0.1" and a.sources["own_addr"] == "interfaces"
    assert discovery.discover(0, None, env={**env, "POD_IP": "127.0.0.2"}).own_addr == "127.0.0.2"
    assert discovery.from_environment({}) == {}
    assert "lo" in discovery.interface_addresses()


def test_discovery_errors(tmp_path):
    with pytest.raises(PodsnapError, match="no master address"):
        discovery.discover(1, None, env={})
    with pytest.raises(PodsnapError, match="MASTER_PORT='http' is not a port"):
        discovery.from_environment({"MASTER_PORT": "http"})
    bad = tmp_path / "m.json"
    bad.write_text('{"generation": 1}')
    with pytest.raises(PodsnapError, match="restore metadata .* is not valid"):
        discovery.from_metadata_file(bad)


# --- port policy ---------------------------------------------------------------------


def test_occupied_port_is_skipped_and_every_rank_agrees():
    base = free_port() // 2 + 10000  # somewhere quiet
    generation = 1
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", rendezvous.candidate_ports(base, generation)[0]))
    blocker.listen()  # an unrelated program holds the port the policy would pick first
    try:
        host = rendezvous.host("127.0.0.1", base, generation, 2, timeout_s=10)
        assert host.port == rendezvous.candidate_ports(base, generation)[1]
        found = rendezvous.find("127.0.0.1", base, generation, 2, timeout_s=10)
        assert found.port == host.port  # agreed through the store
        stale = rendezvous.host("127.0.0.1", base, generation + 1, 2, timeout_s=10)  # another generation
        assert rendezvous.find("127.0.0.1", base, generation + 1, 2, timeout_s=10).port == stale.port != host.port
    finally:
        blocker.close()


def test_ranks_form_a_group_past_an_occupied_port():
    """Two real processes form a gloo group of generation 1 while its first port is taken."""
    from tests_helpers import join_and_sum

    base = 20000 + free_port() % 20000
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", rendezvous.candidate_ports(base, 1)[0]))
    blocker.listen()
    try:
        total, port = run_on_ranks(join_and_sum, 2, base, 1)
    finally:
        blocker.close()
    assert total == 1.0 + 2.0 and port == rendezvous.candidate_ports(base, 1)[1]


# --- teardown with a dead peer ---------------------------------------------------------


def test_teardown_with_a_dead_peer_returns_within_its_timeout():
    base = 20000 + free_port() % 20000
    peer = subprocess.Popen([sys.executable, "-c", (
        "from podsnap.comm_rebuild import groups; import time;"
        f"groups.join('127.0.0.1', {base}, 0, 1, 2, timeout_s=30); print('joined', flush=True); time.sleep(600)")],
        stdout=subprocess.PIPE, text=True)
    try:
        groups.join("127.0.0.1", base, 0, 0, 2, timeout_s=30)
        assert peer.stdout.readline().strip() == "joined"
        kill_tree(peer.pid)
        t = time.monotonic()
        with pytest.raises(RuntimeError):
            dist.all_reduce(torch.ones(1))  # the peer is gone: the collective fails, it does not hang
        took = groups.teardown(timeout_s=5)
        assert took < 5 and time.monotonic() - t < 35
        assert not groups.is_distributed() and groups.registry.get("tp") is None
    finally:
        kill_tree(peer.pid)
        groups.teardown(timeout_s=5)


# --- TP=2 across pods --------------------------------------------------------------------

def test_follower_moves_to_a_new_pod(pod_network, tp2_snapshot, tmp_path):
    store, expected = tp2_snapshot
    a, b, c = (pod_network.add(n) for n in ("a", "b", "c"))
    master = f"{a.ip}:29500"
    ranks = [Rank(a, 0, store, "--master", master), Rank(b, 1, store, "--master", master)]
    try:
        url = ranks[0].wait_serving()
        stream = Stream([url])
        stream.wait_answered(3)
        ranks[1].crash()  # rank 1's pod dies; requests keep arriving at rank 0
        meta = tmp_path / "restore-c.json"
        RestoreMetadata(1, a.ip, 29500, {0: a.ip, 1: c.ip}).write(meta)
        ranks.append(Rank(c, 1, store, "--restore-metadata", str(meta)))  # warm restore, then join
        assert stream.finish() == expected  # no request lost, tokens as if nothing happened
        h = health(url)
        assert h["generation"] == 1 and h["active"] == [True, True]
        assert h["last_join"]["cause"] == "failure"
    finally:
        for r in ranks:
            r.kill()
            print(f"--- rank in pod {r.pod.name}:\n" + "".join(r.lines[-40:]))


def test_master_moves_to_a_new_pod(pod_network, tp2_snapshot, tmp_path):
    store, expected = tp2_snapshot
    a, b, c = (pod_network.add(n) for n in ("a", "b", "c"))
    meta = tmp_path / "restore.json"  # rank 1 polls this file once its master is gone
    ranks = [Rank(a, 0, store, "--master", f"{a.ip}:29500"),
             Rank(b, 1, store, "--master", f"{a.ip}:29500", "--restore-metadata", str(meta))]
    try:
        old_url = ranks[0].wait_serving()
        stream = Stream([old_url])
        stream.wait_answered(3)
        ranks[0].crash()  # the master's pod dies
        RestoreMetadata(1, c.ip, 29500, {0: c.ip, 1: b.ip}).write(meta)  # what the controller writes
        ranks.append(Rank(c, 0, store, "--restore-metadata", str(meta)))
        new_url = ranks[-1].wait_serving()
        stream.endpoints.append(new_url)  # the Service now points at the new pod
        assert stream.finish() == expected
        h = health(new_url)
        assert h["generation"] == 1 and h["active"] == [True, True]
    finally:
        for r in ranks:
            r.kill()
            print(f"--- rank in pod {r.pod.name}:\n" + "".join(r.lines[-40:]))


def test_planned_move_through_the_admin_api(tp2_snapshot, tmp_path):
    """POST /admin/rebuild: a replacement rank 1 (warm-restored, waiting for generation 1) takes over
    and the old rank 1 leaves; serving continues with the same tokens."""
    store, expected = tp2_snapshot
    pod = LocalPod(free_port())
    base = 20000 + free_port() % 30000
    ranks = [Rank(pod, 0, store, "--master", f"127.0.0.1:{base}"), Rank(pod, 1, store, "--master", f"127.0.0.1:{base}")]
    try:
        url = ranks[0].wait_serving().replace(":8000", f":{pod.port}")
        first = [request_json(f"{url}/v1/completions", {"prompt": p, "max_tokens": MAX_TOKENS})[1]
                 for p in PROMPTS[:4]]
        meta = tmp_path / "move.json"
        RestoreMetadata(1, "127.0.0.1", base, {0: "127.0.0.1", 1: "127.0.0.1"}).write(meta)
        ranks.append(Rank(pod, 1, store, "--restore-metadata", str(meta)))  # the new pod, restoring alone
        status, body = request_json(f"{url}/admin/rebuild", {"generation": 1, "leave": [1]}, timeout=300)
        assert status == 200, body
        assert body["generation"] == 1 and body["cause"] == "admin"
        assert ranks[1].proc.wait(60) == 0  # the replaced rank exited cleanly
        assert "replaced by a new pod" in "".join(ranks[1].lines)
        rest = [request_json(f"{url}/v1/completions", {"prompt": p, "max_tokens": MAX_TOKENS})[1]
                for p in PROMPTS[4:]]
        assert [b["choices"][0]["token_ids"] for b in first + rest] == expected
        assert request_json(f"{url}/admin/rebuild", {"generation": 0})[0] == 400  # not above the current one
    finally:
        for r in ranks:
            r.kill()
