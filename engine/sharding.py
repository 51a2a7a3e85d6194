"""Which part of the model one rank holds.

``RankLayout`` lists the query heads, KV heads, MLP intermediate columns and
experts of one rank. ``rows``/``cols`` turn those into the intervals of the
checkpoint tensors that the engine state reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from podsnap.state import Interval

from .config import ModelConfig


@dataclass(frozen=True)
class RankLayout:
    rank: int
    world_size: int
    q_heads: range
    kv_heads: range
    mlp_cols: range  # columns of the dense MLP's intermediate dimension
    experts: list[int] = field(default_factory=list)  # logical expert ids this rank computes

    @classmethod
    def whole(cls, cfg: ModelConfig) -> RankLayout:
        return cls(0, 1, range(cfg.num_attention_heads), range(cfg.num_key_value_heads),
                   range(cfg.intermediate_size), list(range(cfg.num_experts)))

    @staticmethod
    def rows(logical: str, start: int, stop: int, size: int) -> Interval:
        return Interval(logical, 0, start, stop, size)

    @staticmethod
    def cols(logical: str, start: int, stop: int, size: int) -> Interval:
        return Interval(logical, 1, start, stop, size)
