"""Our engine against the Hugging Face transformers reference on the same checkpoints."""

from __future__ import annotations

import pytest
import torch
import transformers  # a test dependency (.[test]); `make test` installs it, so it is never skipped

from podsnap.engine.llm_engine import EngineOptions, LLMEngine

ARCHS = ["llama", "qwen3", "qwen3-moe"]
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]


def hf_model(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def prefill_logits(engine: LLMEngine, prompt: list[int]) -> torch.Tensor:
    engine.add_request(prompt, 1)
    seqs, is_prefill = engine.scheduler.schedule()
    assert is_prefill
    return engine.forward(seqs, last_only=False)


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(model_factory, arch):
    model_dir = model_factory(arch)
    ours = prefill_logits(LLMEngine.cold_start(model_dir, EngineOptions(dtype="float32")), PROMPT)
    with torch.no_grad():
        ref = hf_model(model_dir)(torch.tensor([PROMPT])).logits[0]
    rel = (ours - ref).abs().max() / ref.abs().max()
    assert rel < 1e-4, f"{arch}: max relative logit error {rel:.2e}"


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_match_transformers(model_factory, arch):
    model_dir = model_factory(arch)
    ours = LLMEngine.cold_start(model_dir).generate([PROMPT], max_tokens=12)[0]
    with torch.no_grad():
        out = hf_model(model_dir).generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False,
                                           pad_token_id=0)
    assert ours == out[0, len(PROMPT):].tolist()
