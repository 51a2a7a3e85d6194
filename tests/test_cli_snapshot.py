"""`podsnap snapshot ...` as an operator uses it."""

from __future__ import annotations

import json

from click.testing import CliRunner

from podsnap.cli import main
from podsnap.snapshot.store import Store


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_create_ls_inspect_verify_rm_gc(model_factory, tmp_path):
    model, store = model_factory("qwen3"), tmp_path / "store"
    r = run("snapshot", "create", "--store", store, "--model", model, "--quant", "w8a8", "--name", "a", "--json")
    assert r.exit_code == 0, r.output
    first = json.loads(r.stdout)
    assert first["snapshot"] == "a" and first["bytes_written"] == first["bytes_total"] > 0
    r = run("snapshot", "create", "--store", store, "--model", model, "--quant", "w8a8", "--name", "b")
    assert r.exit_code == 0 and "not written again" in r.output and "wrote 0.0 MiB" in r.output

    listed = json.loads(run("snapshot", "ls", "--store", store, "--json").stdout)
    assert [x["snapshot"] for x in listed] == ["a", "b"] and listed[0]["quant"] == "w8a8"
    manifest = json.loads(run("snapshot", "inspect", "--store", store, "a", "--json").stdout)
    assert manifest["fingerprint"]["quant"] == "w8a8"

    ok = json.loads(run("snapshot", "verify", "--store", store, "a", "--json").stdout)
    assert ok["ok"] and ok["problems"] == []
    record = manifest["ranks"][0]["tensors"][0]
    path = Store(store).blob_path(record["blob"])
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF
    path.write_bytes(bytes(data))
    bad = run("snapshot", "verify", "--store", store, "b")
    assert bad.exit_code == 1 and f"tensor {record['name']}" in bad.output and str(path) in bad.output

    removed = json.loads(run("snapshot", "rm", "--store", store, "a", "--json").stdout)
    assert removed["blobs_removed"] == 0  # every blob of "a" is still used by "b"
    assert json.loads(run("snapshot", "gc", "--store", store, "--json").stdout)["blobs_removed"] == 0
    assert [x["snapshot"] for x in json.loads(run("snapshot", "ls", "--store", store, "--json").stdout)] == ["b"]


def test_operator_errors(model_factory, tmp_path):
    r = run("snapshot", "ls", "--store", tmp_path / "nothing-here")
    assert r.exit_code == 2 and "is not a podsnap store" in r.output
    r = run("snapshot", "create", "--store", tmp_path / "s")
    assert r.exit_code == 2 and "exactly one of --model DIR or --server URL" in r.output
    run("snapshot", "create", "--store", tmp_path / "s", "--model", model_factory("llama"), "--name", "x")
    r = run("snapshot", "inspect", "--store", tmp_path / "s", "nope")
    assert r.exit_code == 2 and "no snapshot 'nope'" in r.output and "latest: x" in r.output
    r = run("generate", "--restore", "no-colon", "--prompt-ids", "1")
    assert r.exit_code == 2 and "is not STORE:SNAPSHOT" in r.output
    r = run("snapshot", "create", "--store", tmp_path / "s", "--server", "http://127.0.0.1:9")
    assert r.exit_code == 2 and "cannot reach" in r.output
