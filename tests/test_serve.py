"""`podsnap serve`: the HTTP API over a real TP=2 group of rank processes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from procs import alive, kill_tree, port_is_free

from podsnap.engine.generate import generate

PROMPTS = [[i % 250 + 1, (7 * i) % 250, 3] * (1 + i % 3) for i in range(16)]


def post(url, body, timeout=60):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def get(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.status, r.read().decode()


@pytest.fixture(scope="module")
def server(model_factory):
    """`podsnap serve --tp 2` in its own session; every rank is stopped by pid afterwards."""
    proc = subprocess.Popen([sys.executable, "-m", "podsnap.cli", "serve", "--model", str(model_factory("llama")),
                             "--tp", "2", "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    pids = []
    try:
        deadline = time.monotonic() + 120
        line = ""
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if m := re.search(r"serving on (http://[\d.]+:(\d+))", line):
                break
            assert line or proc.poll() is None, "server exited before serving"
        else:
            pytest.fail(f"server did not come up: {line}")
        url, port = m.group(1), int(m.group(2))
        yield url
    finally:
        pids = kill_tree(proc.pid)
        proc.wait(10)
    assert not any(alive(p) for p in pids), "a rank process outlived the test"
    assert port_is_free(port), f"port {port} is still bound"


def test_health_and_world_size(server):
    status, body = get(f"{server}/health")
    assert status == 200 and json.loads(body) == {"status": "ok", "world_size": 2}


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
