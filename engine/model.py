"""The decoder-only transformer: Llama, Qwen3 (q/k RMSNorm) and Qwen3-MoE.

Module names follow the HF checkpoint names (``model.layers.0.self_attn.q_proj``),
so the logical name of every checkpoint tensor is the module path plus
``.weight``. A ``RankLayout`` says which heads, MLP columns and experts this
rank holds; the single-rank layout holds everything.

Tokens of all sequences in a step are flattened into one batch for the
linear layers; attention runs per sequence over its paged KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from podsnap.errors import PodsnapError
from podsnap.state import Role, TensorMeta

from . import tp
from .config import ModelConfig
from .layers import Embedding, Linear, RMSNorm, apply_rope
from .sharding import RankLayout


@dataclass
class StepContext:
    """Where each sequence's tokens sit in the flat batch and in the KV cache."""

    positions: torch.Tensor  # (tokens,) position of each token
    slot_mapping: torch.Tensor  # (tokens,) KV-cache slot each token's K/V is written to
    query_lens: list[int]  # new tokens per sequence, in batch order
    context_slots: list[torch.Tensor]  # per sequence: KV slots of its whole context
    cos: torch.Tensor | None = None  # (tokens, head_dim), filled by the model
    sin: torch.Tensor | None = None
    mask: torch.Tensor | None = None  # the causal mask cache


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, prefix: str, layout: RankLayout):
        super().__init__()
        hd = cfg.head_dim
        self.head_dim = hd
        self.n_q = len(layout.q_heads)
        self.n_kv = len(layout.kv_heads)
        q, kv = layout.q_heads, layout.kv_heads
        self.q_proj = Linear(cfg.hidden_size, self.n_q * hd, f"{prefix}.q_proj.weight", "column",
                             layout.rows(f"{prefix}.q_proj.weight", q.start * hd, q.stop * hd,
                                         cfg.num_attention_heads * hd))
        for name in ("k_proj", "v_proj"):
            setattr(self, name, Linear(cfg.hidden_size, self.n_kv * hd, f"{prefix}.{name}.weight", "column",
                                       layout.rows(f"{prefix}.{name}.weight", kv.start * hd, kv.stop * hd,
                                                   cfg.num_key_value_heads * hd)))
        self.o_proj = Linear(self.n_q * hd, cfg.hidden_size, f"{prefix}.o_proj.weight", "row",
                             layout.cols(f"{prefix}.o_proj.weight", q.start * hd, q.stop * hd,
                                         cfg.num_attention_heads * hd))
        if cfg.has_qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, f"{prefix}.q_norm.weight")
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, f"{prefix}.k_norm.weight")
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, ctx: StepContext, k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.n_q, self.head_dim)
        k = self.k_proj(x).view(t, self.n_kv, self.head_dim)
        v = self.v_proj(x).view(t, self.n_kv, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, ctx.cos, ctx.sin), apply_rope(k, ctx.cos, ctx.sin)
        k_flat = k_cache.view(-1, self.n_kv, self.head_dim)
        v_flat = v_cache.view(-1, self.n_kv, self.head_dim)
        k_flat[ctx.slot_mapping] = k.to(k_flat.dtype)
        v_flat[ctx.slot_mapping] = v.to(v_flat.dtype)
        out, start = [], 0
        for n, slots in zip(ctx.query_lens, ctx.context_slots, strict=True):
            length = slots.shape[0]
            keys = k_flat[slots].to(q.dtype).transpose(0, 1)  # (kv, ctx, hd)
            values = v_flat[slots].to(q.dtype).transpose(0, 1)
            mask = ctx.mask[length - n:length, :length]
            o = F.scaled_dot_product_attention(q[start:start + n].transpose(0, 1), keys, values,
                                               attn_mask=mask, enable_gqa=True)
            out.append(o.transpose(0, 1).reshape(n, -1))
            start += n
        return self.o_proj(torch.cat(out))


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int, prefix: str, layout: RankLayout, cols: range | None = None):
        super().__init__()
        cols = cols if cols is not None else range(inter)
        n = len(cols)
        self.gate_proj = Linear(hidden, n, f"{prefix}.gate_proj.weight", "column",
                                layout.rows(f"{prefix}.gate_proj.weight", cols.start, cols.stop, inter))
        self.up_proj = Linear(hidden, n, f"{prefix}.up_proj.weight", "column",
                              layout.rows(f"{prefix}.up_proj.weight", cols.start, cols.stop, inter))
        self.down_proj = Linear(n, hidden, f"{prefix}.down_proj.weight", "row",
                                layout.cols(f"{prefix}.down_proj.weight", cols.start, cols.stop, inter))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    """Top-k routed experts. This rank holds ``layout.held_experts`` and computes
    ``layout.experts`` (it is their first rank); partial outputs are summed over ep."""

    def __init__(self, cfg: ModelConfig, prefix: str, layout: RankLayout):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, f"{prefix}.gate.weight", quantizable=False)
        whole = RankLayout.whole(cfg)  # an expert is never split: its shard is the whole tensor
        self.experts = nn.ModuleDict({
            str(e): MLP(cfg.hidden_size, cfg.moe_intermediate_size, f"{prefix}.experts.{e}", whole)
            for e in layout.held_experts})
        self.computes = [str(e) for e in layout.experts]
        for expert in self.experts.values():  # partial sums are reduced once, over ep, below
            expert.down_proj.parallel = "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(self.gate(x).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for e in self.computes:
            expert = self.experts[e]
            token, slot = (chosen == int(e)).nonzero(as_tuple=True)
            if token.numel():
                out.index_add_(0, token, expert(x[token]) * weights[token, slot, None])
        return tp.all_reduce(out, role="ep")


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int, layout: RankLayout):
        super().__init__()
        prefix = f"model.layers.{i}"
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, f"{prefix}.input_layernorm.weight")
        self.self_attn = Attention(cfg, f"{prefix}.self_attn", layout)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps,
                                                f"{prefix}.post_attention_layernorm.weight")
        if cfg.is_moe:
            self.mlp = MoE(cfg, f"{prefix}.mlp", layout)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, f"{prefix}.mlp", layout, layout.mlp_cols)

    def forward(self, x, ctx, k_cache, v_cache):
        x = x + self.self_attn(self.input_layernorm(x), ctx, k_cache, v_cache)
        return self.ffn(x)

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        """The feed-forward half of the layer (what ``--compile`` compiles)."""
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, layout: RankLayout):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, "model.embed_tokens.weight")
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, layout) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, "model.norm.weight")


class CausalLM(nn.Module):
    """The whole model of one rank. Derived tables live here as buffers:
    ``rope_cos``/``rope_sin`` ``(max_positions, head_dim)`` and ``attn_mask``."""

    def __init__(self, cfg: ModelConfig, layout: RankLayout | None = None):
        super().__init__()
        self.cfg = cfg
        self.layout = layout or RankLayout.whole(cfg)
        self.model = DecoderModel(cfg, self.layout)
        lm_logical = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, lm_logical, quantizable=False)
        self.register_buffer("rope_cos", None)
        self.register_buffer("rope_sin", None)
        self.register_buffer("attn_mask", None)

    def linears(self) -> list[Linear]:
        return [m for m in self.modules() if isinstance(m, Linear)]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, ctx: StepContext, kv_cache, last_only: bool = True) -> torch.Tensor:
        """Logits (fp32) of each sequence's last token, or of every token."""
        ctx.cos, ctx.sin, ctx.mask = self.rope_cos[ctx.positions], self.rope_sin[ctx.positions], self.attn_mask
        x = F.embedding(input_ids, self.model.embed_tokens.weight)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, ctx, kv_cache.k[i], kv_cache.v[i])
        x = self.model.norm(x)
        if last_only:
            x = x[torch.tensor(ctx.query_lens).cumsum(0) - 1]
        return self.lm_head(x).float()

    def state_meta(self) -> dict[str, TensorMeta]:
        """Role, layout and interval of every tensor this rank holds, by module path."""
        metas = {}
        for prefix, module in self.named_modules():
            if hasattr(module, "state_meta") and module is not self:
                for local, meta in module.state_meta().items():
                    metas[f"{prefix}.{local}"] = meta
        for name in ("rope_cos", "rope_sin", "attn_mask"):
            metas[name] = TensorMeta(Role.DERIVED)
        return metas

    def load_state(self, tensors: dict[str, torch.Tensor]) -> None:
        """Put each restored tensor where the module tree expects it (parameters and buffers);
        every meta tensor must be filled."""
        for name, t in tensors.items():
            prefix, _, attr = name.rpartition(".")
            try:
                module = self.get_submodule(prefix) if prefix else self
            except AttributeError:
                raise PodsnapError(f"snapshot tensor {name!r} has no place in this model") from None
            if attr in module._parameters:
                module._parameters[attr] = nn.Parameter(t, requires_grad=False)
            elif attr in module._buffers:
                module._buffers[attr] = t
            else:
                raise PodsnapError(f"snapshot tensor {name!r} has no place in this model")
        for linear in self.linears():  # W8A8 linears keep no float weight
            if linear.qweight is not None and linear.weight is not None and linear.weight.is_meta:
                linear.weight = None
        missing = [n for n, t in [*self.named_parameters(), *self.named_buffers()] if t.is_meta]
        if missing:
            raise PodsnapError(f"the snapshot lacks {len(missing)} tensor(s) this model needs, e.g. {missing[:3]}")

    def drop_state(self) -> int:
        """Replace every tensor by a meta tensor of the same shape and dtype (``load_state`` refills
        them); returns the bytes freed."""
        freed = 0
        for module in self.modules():
            for table in (module._parameters, module._buffers):
                for name, t in table.items():
                    if t is None or t.is_meta:
                        continue
                    freed += t.nbytes
                    meta = torch.empty_like(t, device="meta")
                    table[name] = nn.Parameter(meta, requires_grad=False) if isinstance(t, nn.Parameter) else meta
        return freed
