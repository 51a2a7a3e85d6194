"""Deterministic random HF checkpoints for tests, demos and benchmarks.

``make_tiny`` writes ``config.json`` with the HF field names of the chosen
architecture and the weights under their HF names, in bf16, from a seeded
generator: the same arch, preset and seed give byte-identical files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from podsnap.errors import ConfigError

from .checkpoint import write_checkpoint
from .config import ARCHITECTURES, ModelConfig

ARCHS = tuple(ARCHITECTURES.values())

# name -> (dense fields, MoE overrides). ~1 GiB in bf16 for "1g".
PRESETS = {
    "tiny": (dict(vocab_size=256, hidden_size=64, intermediate_size=272, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=16, max_position_embeddings=256),
             dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48)),
    "small": (dict(vocab_size=2048, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=32, max_position_embeddings=1024),
              dict(num_experts=16, num_experts_per_tok=2, moe_intermediate_size=96)),
    "1g": (dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=9,
                num_attention_heads=16, num_key_value_heads=4, head_dim=128, max_position_embeddings=2048),
           dict(num_experts=16, num_experts_per_tok=2, moe_intermediate_size=704, num_hidden_layers=5)),
}


def preset_config(arch: str, preset: str) -> ModelConfig:
    if arch not in ARCHS:
        raise ConfigError(f"--arch {arch!r} is not supported; choose one of {', '.join(ARCHS)}")
    if preset not in PRESETS:
        raise ConfigError(f"--preset {preset!r} is not known; choose one of {', '.join(PRESETS)}")
    dense, moe = PRESETS[preset]
    fields = dict(dense, arch=arch, rms_norm_eps=1e-6, rope_theta=10000.0)
    if arch == "qwen3-moe":
        fields.update(moe, norm_topk_prob=True)
    return ModelConfig(**fields)


def hf_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the HF checkpoint of ``cfg``, by HF name, in file order."""
    h, hd = cfg.hidden_size, cfg.head_dim
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        shapes[f"{p}.input_layernorm.weight"] = (h,)
        shapes[f"{p}.self_attn.q_proj.weight"] = (cfg.num_attention_heads * hd, h)
        shapes[f"{p}.self_attn.k_proj.weight"] = (cfg.num_key_value_heads * hd, h)
        shapes[f"{p}.self_attn.v_proj.weight"] = (cfg.num_key_value_heads * hd, h)
        shapes[f"{p}.self_attn.o_proj.weight"] = (h, cfg.num_attention_heads * hd)
        if cfg.has_qk_norm:
            shapes[f"{p}.self_attn.q_norm.weight"] = (hd,)
            shapes[f"{p}.self_attn.k_norm.weight"] = (hd,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (h,)
        if cfg.is_moe:
            shapes[f"{p}.mlp.gate.weight"] = (cfg.num_experts, h)
            experts = [(f"{p}.mlp.experts.{e}", cfg.moe_intermediate_size) for e in range(cfg.num_experts)]
        else:
            experts = [(f"{p}.mlp", cfg.intermediate_size)]
        for prefix, inter in experts:
            shapes[f"{prefix}.gate_proj.weight"] = (inter, h)
            shapes[f"{prefix}.up_proj.weight"] = (inter, h)
            shapes[f"{prefix}.down_proj.weight"] = (h, inter)
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def random_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if name.endswith("norm.weight"):  # norms near 1, but not exactly, so they matter
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    std = 0.05 if len(shape) == 2 and shape[1] <= 1024 else 0.02
    return std * torch.randn(shape, generator=gen)


def make_tiny(arch: str, out: str | Path, preset: str = "tiny", seed: int = 0, shards: int = 1,
              progress=None) -> ModelConfig:
    """Write an HF-format checkpoint of ``arch``/``preset`` to ``out``."""
    cfg = preset_config(arch, preset)
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not (out / "config.json").exists():
        raise ConfigError(f"--out {str(out)!r} exists and is not an HF checkpoint directory; "
                          "give an empty or new directory")
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("model*.safetensors*"):
        old.unlink()
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    shapes = hf_tensor_shapes(cfg)
    for name, shape in shapes.items():
        tensors[name] = random_tensor(name, shape, gen).to(torch.bfloat16)
        if progress:
            progress(name)
    write_checkpoint(out, tensors, shards)
    tmp = out / f".config.json.{os.getpid()}"
    tmp.write_text(json.dumps(cfg.to_hf(), indent=2) + "\n")
    tmp.rename(out / "config.json")
    return cfg
