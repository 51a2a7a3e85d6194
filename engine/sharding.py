"""Unequal-width tensor/expert parallelism: which part of the model each rank holds.

No divisibility is needed, so a group can run on any number of ranks:

- attention is split by KV-head groups, each rank taking the query heads of
  its KV heads (GQA). With more ranks than KV heads, each KV head is
  replicated over a few ranks and they share its query heads;
- the dense MLP's intermediate dimension is split in blocks of ``MLP_BLOCK``
  columns (aligned with the int8 FRACTAL_NZ fractal), the remainder spread
  over the first ranks;
- MoE experts are placed whole on ranks: contiguous runs when there are at
  least as many experts as ranks, replicas otherwise; the first rank listed
  for an expert computes it (``RankLayout.experts``).

``ShardPlan`` holds every rank's layout and, per checkpoint tensor and rank,
the interval of the unsharded tensor that rank holds. The intervals are read
off the model itself (built on the meta device), so the plan and the model
can never disagree. Replicated tensors (norms, embeddings, lm_head, the MoE
router) are held whole by every rank: their interval is the full range.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from podsnap.errors import ConfigError
from podsnap.state import Interval

from .config import ModelConfig

MLP_BLOCK = 32  # lcm of the int8 NZ fractal's 16 rows and 32 columns


def split_even(n: int, parts: int) -> list[range]:
    """``range(n)`` cut into ``parts`` contiguous pieces whose sizes differ by at most one."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + base + (i < extra)
        out.append(range(start, stop))
        start = stop
    return out


@dataclass(frozen=True)
class RankLayout:
    rank: int
    world_size: int
    q_heads: range
    kv_heads: range
    mlp_cols: range  # columns of the dense MLP's intermediate dimension
    experts: list[int] = field(default_factory=list)  # experts this rank computes
    held_experts: list[int] = field(default_factory=list)  # experts whose weights it holds (incl. replicas)

    @classmethod
    def whole(cls, cfg: ModelConfig) -> RankLayout:
        experts = list(range(cfg.num_experts))
        return cls(0, 1, range(cfg.num_attention_heads), range(cfg.num_key_value_heads),
                   range(cfg.intermediate_size), experts, experts)

    @staticmethod
    def rows(logical: str, start: int, stop: int, size: int) -> Interval:
        return Interval(logical, 0, start, stop, size)

    @staticmethod
    def cols(logical: str, start: int, stop: int, size: int) -> Interval:
        return Interval(logical, 1, start, stop, size)

    def to_dict(self) -> dict:
        return {"rank": self.rank, "world_size": self.world_size,
                "q_heads": [self.q_heads.start, self.q_heads.stop],
                "kv_heads": [self.kv_heads.start, self.kv_heads.stop],
                "mlp_cols": [self.mlp_cols.start, self.mlp_cols.stop],
                "experts": self.experts, "held_experts": self.held_experts}

    @classmethod
    def from_dict(cls, d: dict) -> RankLayout:
        return cls(d["rank"], d["world_size"], range(*d["q_heads"]), range(*d["kv_heads"]),
                   range(*d["mlp_cols"]), list(d["experts"]), list(d["held_experts"]))


def attention_split(cfg: ModelConfig, world: int) -> list[tuple[range, range]]:
    """(query heads, KV heads) of each rank."""
    kv, group = cfg.num_key_value_heads, cfg.num_attention_heads // cfg.num_key_value_heads
    if world <= kv:
        return [(range(r.start * group, r.stop * group), r) for r in split_even(kv, world)]
    out = []
    for head, ranks in enumerate(split_even(world, kv)):  # ranks sharing KV head `head`
        for q in split_even(group, len(ranks)):
            out.append((range(head * group + q.start, head * group + q.stop), range(head, head + 1)))
    return out


def mlp_split(cfg: ModelConfig, world: int) -> list[range]:
    if cfg.is_moe:
        return [range(cfg.intermediate_size)] * world  # unused: MoE layers have no dense MLP
    blocks = split_even(-(-cfg.intermediate_size // MLP_BLOCK), world)
    return [range(min(b.start * MLP_BLOCK, cfg.intermediate_size), min(b.stop * MLP_BLOCK, cfg.intermediate_size))
            for b in blocks]


def expert_placement(num_experts: int, world: int) -> dict[int, list[int]]:
    """Logical expert -> ranks holding it; the first rank listed computes it."""
    if num_experts == 0:
        return {}
    if world <= num_experts:
        return {e: [r] for r, run in enumerate(split_even(num_experts, world)) for e in run}
    placement: dict[int, list[int]] = {e: [] for e in range(num_experts)}
    for r in range(world):  # every rank holds at least one expert; extra ranks hold replicas
        placement[r % num_experts].append(r)
    return placement


def check_world_size(cfg: ModelConfig, world: int) -> None:
    if world < 1:
        raise ConfigError(f"--tp {world}: the number of ranks must be at least 1")
    if world > cfg.num_attention_heads:
        raise ConfigError(f"--tp {world}: the model has {cfg.num_attention_heads} attention heads, so at most "
                          f"{cfg.num_attention_heads} ranks can each hold a share of attention")
    mlp_blocks = -(-cfg.intermediate_size // MLP_BLOCK)
    if not cfg.is_moe and world > mlp_blocks:
        raise ConfigError(f"--tp {world}: the MLP has {mlp_blocks} blocks of {MLP_BLOCK} columns, so at most "
                          f"{mlp_blocks} ranks can each hold a share of it")


@dataclass
class ShardPlan:
    world_size: int
    layouts: list[RankLayout]
    expert_placement: dict[int, list[int]]
    cfg: ModelConfig | None = field(default=None, repr=False, compare=False)
    # logical tensor -> per rank, the interval it holds (None: it holds none of it); see ``intervals``
    _intervals: dict[str, list[Interval | None]] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def build(cls, cfg: ModelConfig, world: int) -> ShardPlan:
        check_world_size(cfg, world)
        placement = expert_placement(cfg.num_experts, world)
        layouts = []
        for rank, ((q, kv), mlp) in enumerate(zip(attention_split(cfg, world), mlp_split(cfg, world), strict=True)):
            computes = [e for e, ranks in placement.items() if ranks[0] == rank]
            holds = [e for e, ranks in placement.items() if rank in ranks]
            layouts.append(RankLayout(rank, world, q, kv, mlp, computes, holds))
        return cls(world, layouts, placement, cfg)

    @property
    def intervals(self) -> dict[str, list[Interval | None]]:
        """Computed on first use (one meta-device model per rank): a starting rank needs only its layout."""
        if self._intervals is None:
            intervals: dict[str, list[Interval | None]] = {}
            for rank, layout in enumerate(self.layouts):
                for logical, interval in model_intervals(self.cfg, layout).items():
                    intervals.setdefault(logical, [None] * self.world_size)[rank] = interval
            self._intervals = intervals
        return self._intervals

    def to_dict(self, with_intervals: bool = True) -> dict:
        d = {"world_size": self.world_size,
             "layouts": [lay.to_dict() for lay in self.layouts],
             "expert_placement": {str(e): r for e, r in self.expert_placement.items()}}
        if with_intervals:
            d["intervals"] = {name: [i.to_dict() if i else None for i in per_rank]
                              for name, per_rank in self.intervals.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ShardPlan:
        intervals = {name: [Interval.from_dict(i) if i else None for i in per_rank]
                     for name, per_rank in d["intervals"].items()} if "intervals" in d else None
        return cls(d["world_size"], [RankLayout.from_dict(x) for x in d["layouts"]],
                   {int(e): r for e, r in d["expert_placement"].items()}, _intervals=intervals)


def model_intervals(cfg: ModelConfig, layout: RankLayout) -> dict[str, Interval]:
    """Checkpoint tensor -> the interval this rank's model holds, read off a meta-device model."""
    from .loader import checkpoint_modules
    from .model import CausalLM

    with torch.device("meta"):
        model = CausalLM(cfg, layout)
    out = {}
    for m in checkpoint_modules(model):
        shard = getattr(m, "shard", None)
        rows = m.weight.shape[0]
        out[m.logical] = shard if shard is not None else Interval(m.logical, 0, 0, rows, rows)
    return out
