"""One-shot greedy generation on one rank or several (``podsnap generate --tp N``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .launch import run_on_ranks
from .llm_engine import EngineOptions, LLMEngine


@dataclass
class GenerateResult:
    tokens: list[list[int]]
    timings: dict[str, float]
    step_logits: list[torch.Tensor]  # per step, the logits of each running sequence's last token


def lead(engine: LLMEngine, fn):
    """Rank 0 runs ``fn(engine)`` then releases the followers; the others follow until then."""
    if engine.rank != 0:
        engine.follow()
        return None
    try:
        return fn(engine)
    finally:
        engine.stop_followers()


def _generate(engine: LLMEngine, prompts, max_tokens, keep_logits) -> GenerateResult:
    engine.keep_logits = keep_logits
    tokens = engine.generate(prompts, max_tokens)
    return GenerateResult(tokens, engine.timings.to_dict(), engine.step_logits)


def _generate_on_rank(rank, world, model_dir, options, prompts, max_tokens, keep_logits):
    engine = LLMEngine.cold_start(model_dir, options, rank, world)
    return lead(engine, lambda e: _generate(e, prompts, max_tokens, keep_logits))


def generate(model_dir: str | Path, prompts: list[list[int]], max_tokens: int,
             options: EngineOptions | None = None, tp: int = 1, keep_logits: bool = False) -> GenerateResult:
    """Cold-start on ``tp`` ranks (separate processes when > 1) and generate greedily."""
    options = options or EngineOptions()
    if tp == 1:
        return _generate(LLMEngine.cold_start(model_dir, options), prompts, max_tokens, keep_logits)
    return run_on_ranks(_generate_on_rank, tp, str(model_dir), options, prompts, max_tokens, keep_logits)
