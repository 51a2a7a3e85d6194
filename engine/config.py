"""Model configuration read from an HF ``config.json``.

Only the fields the engine uses are read; each one keeps its HF name so a
reader can check it against the model card. Unsupported architectures or
features fail here, before any weight is read.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from podsnap.errors import CheckpointError, ConfigError

# HF "architectures" value -> our short name (the --arch of `podsnap model make-tiny`).
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3-moe",
}


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # "llama" | "qwen3" | "qwen3-moe"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    # Qwen3-MoE only
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def has_qk_norm(self) -> bool:
        return self.arch in ("qwen3", "qwen3-moe")

    @property
    def hf_architecture(self) -> str:
        return next(k for k, v in ARCHITECTURES.items() if v == self.arch)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def load(cls, model_dir: str | Path) -> ModelConfig:
        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise CheckpointError(f"model directory {str(model_dir)!r} does not exist "
                                  "(make one with `podsnap model make-tiny --out DIR`)")
        path = model_dir / "config.json"
        if not path.is_file():
            raise CheckpointError(f"{path} is missing: an HF checkpoint directory needs config.json")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path} is not valid JSON: {e}") from None
        return cls.from_hf(raw, source=str(path))

    @classmethod
    def from_hf(cls, raw: dict, source: str = "config.json") -> ModelConfig:
        archs = raw.get("architectures") or []
        known = [a for a in archs if a in ARCHITECTURES]
        if not known:
            raise ConfigError(f"{source}: architectures={archs!r} is not supported; "
                              f"supported: {', '.join(ARCHITECTURES)}")
        arch = ARCHITECTURES[known[0]]
        scaling = raw.get("rope_scaling")
        if scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default":
            raise ConfigError(f"{source}: rope_scaling={scaling!r} is not supported; "
                              "only the default RoPE is implemented")

        def field(name, default=None, kind=int):
            if name in raw and raw[name] is not None:
                try:
                    return kind(raw[name])
                except (TypeError, ValueError):
                    raise ConfigError(f"{source}: {name}={raw[name]!r} is not a valid "
                                      f"{kind.__name__}") from None
            if default is None:
                raise ConfigError(f"{source}: required field {name!r} is missing")
            return default

        heads = field("num_attention_heads")
        hidden = field("hidden_size")
        rope_theta = raw.get("rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        cfg = cls(
            arch=arch,
            vocab_size=field("vocab_size"),
            hidden_size=hidden,
            intermediate_size=field("intermediate_size"),
            num_hidden_layers=field("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=field("num_key_value_heads", heads),
            head_dim=field("head_dim", hidden // heads if heads else 0),
            rms_norm_eps=field("rms_norm_eps", 1e-6, float),
            rope_theta=float(rope_theta),
            max_position_embeddings=field("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        )
        if arch == "qwen3-moe":
            if raw.get("mlp_only_layers") or field("decoder_sparse_step", 1) != 1:
                raise ConfigError(f"{source}: mixed dense/MoE layers (mlp_only_layers, "
                                  "decoder_sparse_step != 1) are not supported")
            cfg = cls(**{**asdict(cfg),
                         "num_experts": field("num_experts", raw.get("num_local_experts")),
                         "num_experts_per_tok": field("num_experts_per_tok"),
                         "moe_intermediate_size": field("moe_intermediate_size"),
                         "norm_topk_prob": bool(raw.get("norm_topk_prob", False))})
        cfg.validate(source)
        return cfg

    def validate(self, source: str = "config") -> None:
        positive = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "max_position_embeddings"]
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{source}: {name}={getattr(self, name)} must be positive")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"{source}: num_attention_heads={self.num_attention_heads} is not a "
                              f"multiple of num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"{source}: head_dim={self.head_dim} must be even for RoPE")
        if self.is_moe and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(f"{source}: num_experts_per_tok={self.num_experts_per_tok} must be "
                              f"in 1..num_experts={self.num_experts}")

    def to_hf(self) -> dict:
        """The config.json an HF checkpoint of this model carries."""
        d = {
            "architectures": [self.hf_architecture],
            "model_type": {"llama": "llama", "qwen3": "qwen3", "qwen3-moe": "qwen3_moe"}[self.arch],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": False,
            "torch_dtype": "bfloat16",
        }
        if self.is_moe:
            d.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                     moe_intermediate_size=self.moe_intermediate_size,
                     norm_topk_prob=self.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[])
        return d
