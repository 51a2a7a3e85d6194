"""One-shot greedy generation on one rank or several (``podsnap generate --tp N``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from .launch import run_on_ranks
from .llm_engine import EngineOptions, LLMEngine


@dataclass
class GenerateResult:
    tokens: list[list[int]]
    timings: dict[str, float]
    step_logits: list[torch.Tensor]  # per step, the logits of each running sequence's last token
    postprocess_calls: int = 0  # on rank 0: how often post-processing ran (0 after a warm start)
    compile_cache: dict | None = None  # with --compile: inductor FX-graph cache hits/misses on rank 0


def lead(engine: LLMEngine, fn):
    """Rank 0 runs ``fn(engine)`` then releases the followers; the others follow until then."""
    if engine.rank != 0:
        engine.follow()
        return None
    try:
        return fn(engine)
    finally:
        engine.stop_followers()


def warm_up(engine: LLMEngine) -> None:
    """Collective: with --compile, run a prefill and a decode so the graphs exist (rank 0 leads)."""
    if engine.options.compile:
        lead(engine, LLMEngine.warmup)


def _generate(engine: LLMEngine, prompts, max_tokens, keep_logits) -> GenerateResult:
    engine.keep_logits = keep_logits
    tokens = engine.generate(prompts, max_tokens)
    counters = None
    if engine.options.compile:
        from .compile import cache_counters

        counters = cache_counters()
    return GenerateResult(tokens, engine.timings.to_dict(), engine.step_logits, engine.platform.postprocess_calls,
                          counters)


def _generate_on_rank(rank, world, start, prompts, max_tokens, keep_logits):
    return lead(start(rank, world), lambda e: _generate(e, prompts, max_tokens, keep_logits))


def cold(model_dir: str | Path, options: EngineOptions | None = None) -> Callable[[int, int], LLMEngine]:
    """An engine factory ``(rank, world) -> LLMEngine`` that cold-starts from an HF checkpoint."""
    return partial(LLMEngine.cold_start, str(model_dir), options or EngineOptions())


def generate(start: Callable[[int, int], LLMEngine] | str | Path, prompts: list[list[int]], max_tokens: int,
             options: EngineOptions | None = None, tp: int = 1, keep_logits: bool = False) -> GenerateResult:
    """Start an engine on ``tp`` ranks (separate processes when > 1) and generate greedily.

    ``start`` is a picklable engine factory (``cold(...)``, or a warm start
    from ``podsnap.restore``); a path means ``cold(path, options)``.
    """
    if not callable(start):
        start = cold(start, options)
    if tp == 1:
        return _generate(start(0, 1), prompts, max_tokens, keep_logits)
    return run_on_ranks(_generate_on_rank, tp, start, prompts, max_tokens, keep_logits)
