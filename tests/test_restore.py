"""Warm-start restore: identical tokens, no post-processing, fingerprint refusals, layouts, graph cache."""

from __future__ import annotations

import json
import subprocess
import sys
from functools import partial

import pytest
import torch

from podsnap.engine.generate import cold, generate
from podsnap.engine.launch import run_on_ranks
from podsnap.engine.llm_engine import EngineOptions, LLMEngine
from podsnap.restore.warm import FingerprintMismatch, warm_start
from podsnap.snapshot.capture import snapshot_engine, snapshot_on_rank
from podsnap.snapshot.store import Store

PROMPTS = [[1, 2, 3, 4], [77, 5], [9] * 11]


def spy_on_checkpoint_reads(monkeypatch) -> list:
    """Record every HF checkpoint read (none may happen on the restore path)."""
    from podsnap.engine import checkpoint

    calls = []
    real = checkpoint.CheckpointReader.read
    monkeypatch.setattr(checkpoint.CheckpointReader, "read",
                        lambda self, *a, **k: calls.append(a[0]) or real(self, *a, **k))
    return calls


@pytest.mark.parametrize("arch,quant", [("llama", "w8a8"), ("qwen3-moe", "w8a8"), ("qwen3", "none")])
def test_restore_tp1_gives_identical_tokens_without_postprocessing(tmp_path, model_factory, monkeypatch, arch, quant):
    cold_engine = LLMEngine.cold_start(model_factory(arch), EngineOptions(quant=quant))
    snapshot_engine(cold_engine, tmp_path, "s")
    expected = cold_engine.generate(PROMPTS, 8)
    reads = spy_on_checkpoint_reads(monkeypatch)
    restored = warm_start(tmp_path, "s")
    assert restored.generate(PROMPTS, 8) == expected
    assert restored.platform.postprocess_calls == 0 and cold_engine.platform.postprocess_calls == 1
    assert reads == []  # the HF checkpoint was not touched
    assert restored.restored_from.load.verified_bytes == restored.restored_from.load.bytes > 0


@pytest.mark.parametrize("arch", ["llama", "qwen3-moe"])
def test_restore_tp2_gives_identical_tokens(tmp_path, model_factory, arch):
    options = EngineOptions(quant="w8a8")
    run_on_ranks(snapshot_on_rank, 2, cold(model_factory(arch), options), str(tmp_path), "tp2")
    expected = generate(model_factory(arch), PROMPTS, 8, options, tp=2)
    restored = generate(partial(warm_start, str(tmp_path), "tp2"), PROMPTS, 8, tp=2)
    assert restored.tokens == expected.tokens
    assert restored.postprocess_calls == 0 and expected.postprocess_calls == 1
    assert restored.timings["postprocess"] == 0.0


def test_same_layout_different_weights_is_refused(tmp_path, model_factory):
    """The vLLM #59647 case: a fine-tune with the same shapes must not get the old weights."""
    base, finetune = model_factory("llama", seed=0), model_factory("llama", seed=1)
    snapshot_engine(LLMEngine.cold_start(base), tmp_path, "s")
    warm_start(tmp_path, "s", model_dir=base)  # the right model restores
    with pytest.raises(FingerprintMismatch, match=r"'s' does not match this start: weights \(snapshot") as e:
        warm_start(tmp_path, "s", model_dir=finetune)
    assert e.value.fields == ["weights"]


def test_force_restores_despite_a_mismatch(tmp_path, model_factory, capfd):
    snapshot_engine(LLMEngine.cold_start(model_factory("llama")), tmp_path, "s")
    engine = warm_start(tmp_path, "s", model_dir=model_factory("llama", seed=1), force=True)
    assert "warning: --force" in capfd.readouterr().err
    assert len(engine.generate([[1]], 2)[0]) == 2


def test_quant_mismatch_is_named(tmp_path, model_factory):
    snapshot_engine(LLMEngine.cold_start(model_factory("llama"), EngineOptions(quant="w8a8")), tmp_path, "s")
    with pytest.raises(FingerprintMismatch, match=r"quant \(snapshot w8a8, requested none\)"):
        warm_start(tmp_path, "s", options=EngineOptions(quant="none"))
    with pytest.raises(Exception, match="taken on 1 rank.*restoring it on 2"):
        warm_start(tmp_path, "s", rank=0, world_size=2)


def test_portable_snapshot_derives_nz_on_first_use(tmp_path, model_factory):
    cold_engine = LLMEngine.cold_start(model_factory("qwen3"), EngineOptions(quant="w8a8"))
    manifest, _ = snapshot_engine(cold_engine, tmp_path, "p", portable=True)
    record = next(t for t in manifest.ranks[0].tensors if t.name.endswith("q_proj.qweight"))
    assert record.layout == "nd" and record.derive == "nz" and len(record.shape) == 2
    restored = warm_start(tmp_path, "p")
    q = restored.model.model.layers[0].self_attn.q_proj
    assert q.qweight.dim() == 2 and q.derive_on_first_use is not None
    assert restored.generate(PROMPTS, 6) == cold_engine.generate(PROMPTS, 6)
    assert q.qweight.dim() == 4 and q.derive_on_first_use is None  # derived on the first forward
    assert torch.equal(q.qweight, cold_engine.model.model.layers[0].self_attn.q_proj.qweight)


def test_mmap_restore_is_zero_copy_and_identical(tmp_path, model_factory):
    cold_engine = LLMEngine.cold_start(model_factory("llama"), EngineOptions(quant="w8a8"))
    snapshot_engine(cold_engine, tmp_path, "s")
    restored = warm_start(tmp_path, "s", load_mode="mmap")
    emb = restored.model.model.embed_tokens.weight
    assert not emb.untyped_storage().resizable()  # a file mapping, not a heap copy
    assert restored.generate(PROMPTS, 6) == cold_engine.generate(PROMPTS, 6)


def test_verify_modes(tmp_path, model_factory):
    snapshot_engine(LLMEngine.cold_start(model_factory("qwen3-moe")), tmp_path, "s")
    full = warm_start(tmp_path, "s", verify="full").restored_from.load
    sample = warm_start(tmp_path, "s", verify="sample").restored_from.load
    none = warm_start(tmp_path, "s", verify="none").restored_from.load
    assert full.verified_bytes == full.bytes
    assert 0 < sample.verified_bytes < sample.bytes
    assert none.verified_bytes == 0


def test_kv_blocks_are_restored(tmp_path, model_factory):
    engine = LLMEngine.cold_start(model_factory("llama"))
    engine.generate(PROMPTS, 4)  # fills KV blocks
    manifest, _ = snapshot_engine(engine, tmp_path, "kv", with_kv=True)
    assert manifest.with_kv and any(t.role == "kv" for t in manifest.ranks[0].tensors)
    restored = warm_start(tmp_path, "kv")
    assert torch.equal(restored.kv_cache.k, engine.kv_cache.k) and engine.kv_cache.k.abs().sum() > 0


def test_restored_start_hits_the_compile_cache(tmp_path, model_factory):
    """A fresh process restored from a --compile snapshot hits inductor's FX-graph cache and misses nothing."""
    model = str(model_factory("llama"))
    store = tmp_path / "store"
    create = subprocess.run([sys.executable, "-m", "podsnap.cli", "snapshot", "create", "--store", str(store),
                             "--model", model, "--compile", "--name", "c", "--json"],
                            capture_output=True, text=True, timeout=600)
    assert create.returncode == 0, create.stderr
    assert Store(store).load("c").ranks[0].compile_cache is not None
    run = subprocess.run([sys.executable, "-m", "podsnap.cli", "generate", "--restore", f"{store}:c",
                          "--prompt-ids", "1,2,3,4", "--max-tokens", "5", "--json"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["compile_cache"]["fxgraph_cache_hit"] >= 2 and out["compile_cache"]["fxgraph_cache_miss"] == 0
    assert out["postprocess_calls"] == 0
    assert out["tokens"] == generate(model, [[1, 2, 3, 4]], 5).tokens[0]
