"""The engine: determinism, batching, the paged KV cache and the state contract."""

from __future__ import annotations

import pytest
import torch

from podsnap.engine.llm_engine import EngineOptions, LLMEngine
from podsnap.errors import ConfigError, PodsnapError
from podsnap.state import Role

PROMPTS = [[1, 2, 3], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12, 13, 14, 15, 16, 17, 18], [42]]


@pytest.mark.parametrize("quant", ["none", "w8a8"])
def test_two_cold_starts_give_identical_tokens(model_factory, quant):
    model_dir = model_factory("qwen3-moe")
    runs = [LLMEngine.cold_start(model_dir, EngineOptions(quant=quant)).generate(PROMPTS, 10) for _ in range(2)]
    assert runs[0] == runs[1]


def test_batched_equals_one_by_one(model_factory):
    model_dir = model_factory("llama")
    engine = LLMEngine.cold_start(model_dir)
    batched = engine.generate(PROMPTS, 10)
    assert batched == [engine.generate([p], 10)[0] for p in PROMPTS]


def test_small_kv_cache_preempts_and_still_gives_same_tokens(model_factory):
    """With room for few blocks, sequences are preempted and recomputed; tokens do not change."""
    model_dir = model_factory("llama")
    roomy = LLMEngine.cold_start(model_dir).generate(PROMPTS, 20)
    tight = LLMEngine.cold_start(model_dir, EngineOptions(block_size=4, kv_cache_tokens=40))
    assert tight.generate(PROMPTS, 20) == roomy
    assert len(tight.blocks.free_blocks) == tight.kv_cache.num_blocks  # every block came back


def test_state_contract_w8a8(model_factory):
    engine = LLMEngine.cold_start(model_factory("qwen3"), EngineOptions(quant="w8a8"))
    state = engine.state()
    by_name = state.by_name()
    q = by_name["model.layers.0.self_attn.q_proj.qweight"]
    assert q.meta.role is Role.DERIVED and q.meta.layout == "nz" and q.dtype == "int8"
    assert q.meta.interval.logical == "model.layers.0.self_attn.q_proj.weight"
    assert (q.meta.interval.start, q.meta.interval.stop) == (0, 128)
    assert "model.layers.0.self_attn.q_proj.weight" not in by_name  # the float weight is gone
    assert by_name["model.layers.0.self_attn.q_proj.wscale"].meta.role is Role.DERIVED
    assert by_name["lm_head.weight"].meta.role is Role.PARAMETER  # not quantized
    for name in ("rope_cos", "rope_sin", "attn_mask"):
        assert by_name[name].meta.role is Role.DERIVED
    assert by_name["rope_cos"].shape == (256, 16)
    assert not state.of_role(Role.KV)
    assert len(engine.state(with_kv=True).of_role(Role.KV)) == 2
    assert engine.platform.postprocess_calls == 1


def test_state_contract_unquantized_covers_every_checkpoint_tensor(model_factory):
    from podsnap.engine.checkpoint import CheckpointReader

    model_dir = model_factory("qwen3-moe")
    engine = LLMEngine.cold_start(model_dir)
    params = {t.name for t in engine.state().of_role(Role.PARAMETER)}
    assert params == set(CheckpointReader(model_dir).locations)


def test_bad_requests_and_options(model_factory):
    engine = LLMEngine.cold_start(model_factory("llama"))
    with pytest.raises(PodsnapError, match="out of range: valid ids are 0..255"):
        engine.generate([[1, 999]], 4)
    with pytest.raises(PodsnapError, match="empty"):
        engine.generate([[]], 4)
    with pytest.raises(PodsnapError, match="max_position_embeddings=256"):
        engine.generate([[1] * 250], 10)
    with pytest.raises(ConfigError, match="quant 'fp4'"):
        EngineOptions(quant="fp4")
    with pytest.raises(ConfigError, match="dtype 'float16'"):
        EngineOptions(dtype="float16")


def test_bfloat16_runs(model_factory):
    engine = LLMEngine.cold_start(model_factory("llama"), EngineOptions(dtype="bfloat16"))
    assert engine.model.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    assert len(engine.generate([[1, 2, 3]], 5)[0]) == 5
