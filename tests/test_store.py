"""The snapshot store: permissions, dedupe, atomic commit, rm/gc, integrity and crash safety."""

from __future__ import annotations

import json
import os
import random
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from procs import kill_tree

from podsnap.engine.llm_engine import EngineOptions, LLMEngine
from podsnap.restore.loader import IntegrityError
from podsnap.restore.warm import warm_start
from podsnap.snapshot.capture import snapshot_engine, snapshot_on_rank
from podsnap.snapshot.manifest import ManifestError
from podsnap.snapshot.store import Store, StoreError

CHILD = str(Path(__file__).with_name("snapshot_child.py"))


@pytest.fixture
def engine(model_factory):
    return LLMEngine.cold_start(model_factory("qwen3"), EngineOptions(quant="w8a8"))


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_files_are_private(tmp_path, engine):
    snapshot_engine(engine, tmp_path / "s", "a")
    root = tmp_path / "s"
    for p in [root, *root.rglob("*")]:
        assert mode(p) == (0o700 if p.is_dir() else 0o600), p


def test_second_snapshot_of_unchanged_state_writes_nothing(tmp_path, engine):
    _, first = snapshot_engine(engine, tmp_path, "a")
    _, second = snapshot_engine(engine, tmp_path, "b")
    assert first.bytes_written > 0
    assert second.bytes_written == 0 and second.blobs_written == 0
    assert second.bytes_deduplicated == second.bytes_total > 0


def test_identical_tensors_across_ranks_are_stored_once(tmp_path, model_factory):

    from podsnap.engine.generate import cold
    from podsnap.engine.launch import run_on_ranks

    run_on_ranks(snapshot_on_rank, 2, cold(model_factory("llama")), str(tmp_path), "tp2")
    m = Store(tmp_path).load("tp2")
    rank0, rank1 = ({t.name: t.blob for t in r.tensors} for r in m.ranks)
    assert rank0["model.embed_tokens.weight"] == rank1["model.embed_tokens.weight"]  # replicated
    blobs = list((tmp_path / "blobs").glob("*/*"))
    assert len(blobs) == len(m.blobs()) < len(rank0) + len(rank1)


def test_names_are_checked_and_never_replaced(tmp_path, engine):
    snapshot_engine(engine, tmp_path, "a")
    with pytest.raises(StoreError, match="'a' already exists"):
        snapshot_engine(engine, tmp_path, "a")
    for bad in ["../x", "a/b", ".hidden", "x" * 200, "a b"]:
        with pytest.raises(StoreError, match="is not valid"):
            snapshot_engine(engine, tmp_path, bad)


def test_rm_and_gc_keep_blobs_other_snapshots_use(tmp_path, engine, model_factory):
    snapshot_engine(engine, tmp_path, "a")
    other = LLMEngine.cold_start(model_factory("qwen3"), EngineOptions(quant="none"))
    snapshot_engine(other, tmp_path, "b")
    store = Store(tmp_path)
    shared = store.load("a").blobs() & store.load("b").blobs()
    assert shared  # norms, embeddings, RoPE tables are the same in both
    result = store.remove("a")
    assert result.blobs_removed > 0
    assert all(store.has_blob(b) for b in store.load("b").blobs())
    (tmp_path / "tmp" / "leftover").write_bytes(b"x")
    gc = store.gc()
    assert gc.tmp_removed == 1 and gc.blobs_removed == 0
    assert warm_start(tmp_path, "b").generate([[1, 2]], 4) == other.generate([[1, 2]], 4)


def test_flipped_byte_is_detected_naming_tensor_and_file(tmp_path, engine):
    manifest, _ = snapshot_engine(engine, tmp_path, "a")
    rng = random.Random(7)
    for record in rng.sample(manifest.ranks[0].tensors, 3):
        path = Store(tmp_path).blob_path(record.blob)
        data = bytearray(path.read_bytes())
        i = rng.randrange(len(data))
        data[i] ^= 0x01
        os.chmod(path, 0o600)
        path.write_bytes(bytes(data))
        with pytest.raises(IntegrityError, match=rf"tensor {record.name}: blob {path} does not match its hash"):
            warm_start(tmp_path, "a")
        data[i] ^= 0x01
        path.write_bytes(bytes(data))
    warm_start(tmp_path, "a")  # repaired: restores again


def test_truncated_blob_is_detected(tmp_path, engine):
    manifest, _ = snapshot_engine(engine, tmp_path, "a")
    record = max(manifest.ranks[0].tensors, key=lambda t: t.length)
    path = Store(tmp_path).blob_path(record.blob)
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(IntegrityError, match=rf"tensor {record.name}: blob {path} has .* \(truncated\)"):
        warm_start(tmp_path, "a", verify="none")


@pytest.mark.parametrize("damage,message", [
    (lambda t: t[: len(t) // 2], "is not valid JSON"),
    (lambda t: "[]", "is not a JSON object"),
    (lambda t: json.dumps({**json.loads(t), "schema": 99}), "has schema 99"),
    (lambda t: json.dumps({k: v for k, v in json.loads(t).items() if k != "ranks"}), "does not follow the manifest"),
])
def test_damaged_manifest_gives_a_clear_error(tmp_path, engine, damage, message):
    snapshot_engine(engine, tmp_path, "a")
    path = tmp_path / "manifests" / "a.json"
    path.write_text(damage(path.read_text()))
    with pytest.raises(ManifestError, match=message):
        warm_start(tmp_path, "a")


class Writer:
    """tests/snapshot_child.py in its own process, stopped by pid at the end."""

    def __init__(self, model_dir, store, name, kv_seed):
        self.proc = subprocess.Popen([sys.executable, CHILD, str(model_dir), str(store), name, str(kv_seed)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "ready"

    def go(self) -> None:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "writing"

    def finish(self) -> tuple[int, str]:
        out, _ = self.proc.communicate(timeout=120)
        return self.proc.returncode, out

    def stop(self) -> None:
        kill_tree(self.proc.pid)
        self.proc.wait()


def all_blobs_verify(store: Store, snap: str) -> bool:
    m = store.load(snap)
    return all(store.verify_blob(t.blob, t.length) is None for r in m.ranks for t in r.tensors)


def test_crash_at_any_point_leaves_earlier_snapshots_intact(tmp_path, model_factory):
    """SIGKILL a snapshot writer at seeded random points (25 trials) while it writes new blobs.

    Each writer is a separate process with fresh KV-cache contents (so it has
    new blobs to write); it is killed after a random delay spread over its
    whole write (measured from an uninterrupted run). After every kill, every
    listed snapshot must verify: none may be partial.
    """
    model_dir = model_factory("llama", "small")
    store = Store(tmp_path)
    rng = random.Random(1234)
    base = Writer(model_dir, tmp_path, "base", 0)
    base.go()
    code, out = base.finish()
    assert code == 0, out
    full = float(out.split()[-1])
    committed, interrupted = {"base"}, 0
    for trial in range(25):
        name = f"t{trial}"
        writer = Writer(model_dir, tmp_path, name, trial + 1)
        try:
            writer.go()
            time.sleep(rng.uniform(0, full * 1.2))
            os.kill(writer.proc.pid, signal.SIGKILL)
        finally:
            writer.stop()
        listed = set(store.list_ids())
        assert committed <= listed <= committed | {name}
        interrupted += name not in listed
        committed = listed
        for snap in listed:
            assert all_blobs_verify(store, snap), snap
    assert interrupted >= 5, f"only {interrupted} of 25 writers were interrupted before their commit"
    store.gc()
    engine = LLMEngine.cold_start(model_dir, EngineOptions(quant="w8a8"))
    reference = engine.generate([[1, 2, 3]], 6)
    for snap in sorted(committed):
        assert warm_start(tmp_path, snap).generate([[1, 2, 3]], 6) == reference


def test_concurrent_writers_are_safe(tmp_path, model_factory):
    """Three writers released at once: two names commit, the duplicate name is refused."""
    model_dir = model_factory("llama")
    writers = [Writer(model_dir, tmp_path, name, seed) for name, seed in (("x", 1), ("y", 2), ("x", 3))]
    try:
        for w in writers:
            w.proc.stdin.write("go\n")
            w.proc.stdin.flush()
        codes = sorted(w.finish()[0] for w in writers)
    finally:
        for w in writers:
            w.stop()
    assert codes == [0, 0, 3]  # the second "x" is refused, not merged or replaced
    store = Store(tmp_path)
    assert set(store.list_ids()) == {"x", "y"}
    assert all_blobs_verify(store, "x") and all_blobs_verify(store, "y")
