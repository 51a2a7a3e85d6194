"""The sharding plan: every rank count works and the intervals cover each tensor exactly."""

from __future__ import annotations

import json

import pytest
import torch

from podsnap.engine.sharding import ShardPlan, expert_placement, split_even
from podsnap.engine.tiny import preset_config
from podsnap.errors import ConfigError


def expected_copies(cfg, plan, logical: str, world: int) -> torch.Tensor:
    """How many ranks should hold each row/column along the sharded dim."""
    size = plan.intervals[logical][0].size if plan.intervals[logical][0] else None
    size = size or next(i.size for i in plan.intervals[logical] if i)
    if ".experts." in logical:
        expert = int(logical.split(".experts.")[1].split(".")[0])
        return torch.full((size,), len(plan.expert_placement[expert]))
    if logical.endswith(("k_proj.weight", "v_proj.weight")) and world > cfg.num_key_value_heads:
        per_head = [len(r) for r in split_even(world, cfg.num_key_value_heads)]
        return torch.tensor(per_head).repeat_interleave(cfg.head_dim)
    if logical.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")) or (
            ".mlp." in logical and not cfg.is_moe):
        return torch.ones(size, dtype=torch.long)
    return torch.full((size,), world)  # replicated: norms, embeddings, lm_head, router


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3-moe"])
@pytest.mark.parametrize("preset", ["tiny", "small"])
@pytest.mark.parametrize("world", range(1, 9))
def test_intervals_cover_every_tensor_exactly(arch, preset, world):
    cfg = preset_config(arch, preset)
    plan = ShardPlan.build(cfg, world)
    assert len(plan.layouts) == world
    for logical, per_rank in plan.intervals.items():
        held = [i for i in per_rank if i is not None]
        size, dim = held[0].size, held[0].dim
        assert all(i.size == size and i.dim == dim and i.logical == logical for i in held)
        copies = torch.zeros(size, dtype=torch.long)
        for i in held:
            assert 0 <= i.start <= i.stop <= size
            copies[i.start:i.stop] += 1
        assert torch.equal(copies, expected_copies(cfg, plan, logical, world)), logical


@pytest.mark.parametrize("world", range(1, 9))
def test_query_heads_follow_their_kv_group(world):
    cfg = preset_config("qwen3", "tiny")
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    plan = ShardPlan.build(cfg, world)
    for layout in plan.layouts:
        assert len(layout.q_heads) >= 1
        assert {h // group for h in layout.q_heads} == set(layout.kv_heads)
    assert sorted(h for lay in plan.layouts for h in lay.q_heads) == list(range(cfg.num_attention_heads))


@pytest.mark.parametrize("world", [1, 3, 8])
def test_every_expert_is_computed_by_exactly_one_rank(world):
    cfg = preset_config("qwen3-moe", "small")  # 16 experts
    plan = ShardPlan.build(cfg, world)
    computed = sorted(e for lay in plan.layouts for e in lay.experts)
    assert computed == list(range(cfg.num_experts))
    for lay in plan.layouts:
        assert set(lay.experts) <= set(lay.held_experts)


@pytest.mark.parametrize("experts,world", [(4, 7), (3, 3), (5, 2), (2, 8)])
def test_expert_placement_for_any_expert_and_rank_count(experts, world):
    placement = expert_placement(experts, world)
    assert sorted(placement) == list(range(experts))
    holders = sorted(r for ranks in placement.values() for r in ranks)
    assert set(holders) == set(range(min(world, max(world, experts))))  # every rank holds something
    if world > experts:
        assert holders == list(range(world))  # replicas: each rank holds exactly one expert
    firsts = [ranks[0] for ranks in placement.values()]
    assert len(set(firsts)) == min(experts, world)  # computation is spread over ranks


def test_mlp_shards_are_block_aligned_with_remainder_spread():
    cfg = preset_config("llama", "small")  # intermediate 704 = 22 blocks of 32
    widths = [len(lay.mlp_cols) for lay in ShardPlan.build(cfg, 3).layouts]
    assert widths == [256, 224, 224] and sum(widths) == 704
    assert all(lay.mlp_cols.start % 32 == 0 for lay in ShardPlan.build(cfg, 5).layouts)


def test_plan_round_trips_through_json():
    plan = ShardPlan.build(preset_config("qwen3-moe", "tiny"), 3)
    again = ShardPlan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again.to_dict() == plan.to_dict() and again.layouts == plan.layouts


def test_bad_rank_counts():
    cfg = preset_config("llama", "tiny")
    with pytest.raises(ConfigError, match="--tp 0: the number of ranks must be at least 1"):
        ShardPlan.build(cfg, 0)
    with pytest.raises(ConfigError, match="--tp 9: the model has 8 attention heads"):
        ShardPlan.build(cfg, 9)
