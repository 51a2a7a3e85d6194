"""`podsnap serve`: the HTTP API over a real TP=2 group of rank processes."""

from __future__ import annotations

import json
import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from procs import alive, port_is_free

from podsnap.client import ServerProcess, request_json
from podsnap.engine.generate import generate

PROMPTS = [[i % 250 + 1, (7 * i) % 250, 3] * (1 + i % 3) for i in range(16)]


def post(url, body):
    return request_json(url, body, timeout=120)


def get(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.status, r.read().decode()


@pytest.fixture(scope="module")
def server(model_factory):
    """`podsnap serve --tp 2`; afterwards no rank process is left and no port stays bound."""
    srv = ServerProcess(["--model", str(model_factory("llama")), "--tp", "2"])
    pids = srv.pids()
    port = int(srv.url.rsplit(":", 1)[1])
    try:
        yield srv.url
    finally:
        srv.stop()
    assert len(pids) == 3  # the launcher and two ranks
    assert not any(alive(p) for p in pids), "a rank process outlived the test"
    assert port_is_free(port), f"port {port} is still bound"


def test_health_and_world_size(server):
    status, body = get(f"{server}/health")
    health = json.loads(body)
    assert status == 200 and health["status"] == "ok" and health["world_size"] == 2
    assert health["startup"]["restored"] is False and health["startup"]["load"] > 0


def test_sixteen_concurrent_requests_match_generate(server, model_factory):
    expected = [generate(model_factory("llama"), [p], 8).tokens[0] for p in PROMPTS]
    with ThreadPoolExecutor(16) as pool:
        replies = list(pool.map(lambda p: post(f"{server}/v1/completions",
                                               {"prompt": p, "max_tokens": 8, "temperature": 0}), PROMPTS))
    for (status, body), want in zip(replies, expected, strict=True):
        assert status == 200, body
        choice = body["choices"][0]
        assert choice["token_ids"] == want and choice["finish_reason"] == "length"
        assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] == 8
    _, metrics = get(f"{server}/metrics")
    tokens = float(re.search(r"^podsnap_generated_tokens_total (\S+)$", metrics, re.M).group(1))
    assert tokens >= 16 * 8
    assert 'podsnap_step_latency_seconds_count{kind="decode"}' in metrics


@pytest.mark.parametrize("body,message", [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    ({"prompt": "hello"}, "'prompt' must be a non-empty list of token ids"),
    ({"prompt": [1, 2], "max_tokens": 0}, "'max_tokens' must be a positive integer"),
    ({"prompt": [1, 2], "temperature": 0.7}, "'temperature' 0.7 is not supported"),
    ({"prompt": [1, 99999]}, "out of range: valid ids are 0..255"),
    ({"prompt": [1] * 250, "max_tokens": 10}, "max_position_embeddings=256"),
])
def test_bad_requests_get_400_with_a_message(server, body, message):
    status, reply = post(f"{server}/v1/completions", body)
    assert status == 400 and message in reply["error"]["message"]


def test_server_keeps_serving_after_bad_requests(server):
    post(f"{server}/v1/completions", b"garbage")
    status, body = post(f"{server}/v1/completions", {"prompt": [5, 6], "max_tokens": 2})
    assert status == 200 and len(body["choices"][0]["token_ids"]) == 2


def test_snapshot_of_a_running_server_then_restore(model_factory, tmp_path):
    """POST /admin/snapshot on a TP=2 server while requests stream in; all requests are served,
    and a TP=2 restore from that snapshot gives the server's tokens."""
    from functools import partial

    from podsnap.restore.warm import warm_start
    from podsnap.snapshot.store import Store

    store = tmp_path / "store"
    with ServerProcess(["--model", str(model_factory("qwen3-moe")), "--quant", "w8a8", "--tp", "2",
                        "--store", str(store)]) as srv:
        url = srv.url
        with ThreadPoolExecutor(9) as pool:
            requests = [pool.submit(post, f"{url}/v1/completions", {"prompt": p, "max_tokens": 12})
                        for p in PROMPTS[:8]]
            snap = pool.submit(post, f"{url}/admin/snapshot", {"name": "live", "with_kv": True})
            replies = [r.result() for r in requests]
            status, body = snap.result()
        assert status == 200, body
        assert body["snapshot"] == "live" and body["tensors"] > 0 and body["paused_seconds"] > 0
        assert all(s == 200 for s, _ in replies)  # queued during the snapshot, none dropped
        assert post(f"{url}/admin/snapshot", {"name": "live"})[0] == 409
        assert post(f"{url}/admin/snapshot", {"name": "../etc"})[0] == 400
        assert post(f"{url}/admin/snapshot", {"store": "/tmp/elsewhere"})[0] == 400  # paths are not taken
    manifest = Store(store).load("live")
    assert manifest.world_size == 2 and manifest.with_kv
    restored = generate(partial(warm_start, str(store), "live"), PROMPTS[:8], 12, tp=2)
    assert restored.tokens == [b["choices"][0]["token_ids"] for _, b in replies]


def test_admin_api_is_loopback_only_or_needs_the_token():
    from podsnap.engine.server import admin_denied

    assert admin_denied(None, "127.0.0.1", None) is None
    assert admin_denied(None, "::ffff:127.0.0.1", None) is None
    status, body = admin_denied(None, "10.242.0.5", None)
    assert status == 403 and "loopback callers only (not 10.242.0.5)" in body["error"]["message"]
    assert admin_denied("s3cret", "10.242.0.5", "Bearer s3cret") is None
    assert admin_denied("s3cret", "127.0.0.1", None)[0] == 401  # with a token, loopback needs it too
    assert admin_denied("s3cret", "10.242.0.5", "Bearer wrong")[0] == 401


def test_admin_token_over_http(model_factory, monkeypatch, tmp_path):
    """A server started with PODSNAP_ADMIN_TOKEN refuses admin calls without it; the client sends it."""
    monkeypatch.setenv("PODSNAP_ADMIN_TOKEN", "s3cret")
    with ServerProcess(["--model", str(model_factory("llama")), "--tp", "1", "--store", str(tmp_path)]) as srv:
        monkeypatch.delenv("PODSNAP_ADMIN_TOKEN")
        assert post(f"{srv.url}/admin/snapshot", {"name": "x"})[0] == 401
        monkeypatch.setenv("PODSNAP_ADMIN_TOKEN", "s3cret")
        status, body = post(f"{srv.url}/admin/snapshot", {"name": "x"})
        assert status == 200 and body["snapshot"] == "x"
