"""Building blocks: RMSNorm, RoPE, and the linear layer in its two forms.

A ``Linear`` holds either the checkpoint weight (``weight``, role parameter)
or, after W8A8 post-processing, ``qweight`` (int8, FRACTAL_NZ) and ``wscale``
(fp32 per output channel), both role derived. ``shard`` says which rows
(column-parallel) or columns (row-parallel) of the checkpoint tensor it holds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from podsnap.state import Interval, Role, TensorMeta

from . import nz, quant, tp


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, logical: str):
        super().__init__()
        self.eps = eps
        self.logical = logical
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def state_meta(self) -> dict[str, TensorMeta]:
        return {"weight": TensorMeta(Role.PARAMETER)}


class Embedding(nn.Module):
    def __init__(self, vocab: int, dim: int, logical: str):
        super().__init__()
        self.logical = logical
        self.weight = nn.Parameter(torch.empty(vocab, dim), requires_grad=False)

    def state_meta(self) -> dict[str, TensorMeta]:
        return {"weight": TensorMeta(Role.PARAMETER)}


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``(tokens, heads, head_dim)`` by per-token ``cos``/``sin`` ``(tokens, head_dim)``."""
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Linear(nn.Module):
    """``y = x @ W.T`` over a shard of the checkpoint weight ``logical`` ``(out, in)``.

    ``parallel`` is "none", "column" (this rank holds rows ``shard`` of W, so
    a slice of the outputs) or "row" (columns ``shard`` of W; partial sums are
    all-reduced over the tp group).
    """

    def __init__(self, in_features: int, out_features: int, logical: str,
                 parallel: str = "none", shard: Interval | None = None, quantizable: bool = True):
        super().__init__()
        self.logical = logical
        self.parallel = parallel
        self.shard = shard
        self.quantizable = quantizable
        self.in_features, self.out_features = in_features, out_features
        self.weight: nn.Parameter | None = nn.Parameter(torch.empty(out_features, in_features),
                                                        requires_grad=False)
        self.register_buffer("qweight", None)  # int8 FRACTAL_NZ of weight.T, after W8A8
        self.register_buffer("wscale", None)  # fp32 scale per output channel, after W8A8
        self.derive_on_first_use = None  # restore: converts an ND qweight to the device layout

    @property
    def is_quantized(self) -> bool:
        return self.qweight is not None

    def set_quantized(self, qweight: torch.Tensor, wscale: torch.Tensor) -> None:
        """Replace the checkpoint weight with its W8A8 form (frees the float weight)."""
        self.weight = None
        self.qweight, self.wscale = qweight, wscale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.is_quantized:
            y = F.linear(x, self.weight)
            return tp.all_reduce(y) if self.parallel == "row" else y
        return self._forward_w8a8(x)

    def _forward_w8a8(self, x: torch.Tensor) -> torch.Tensor:
        if self.derive_on_first_use is not None:  # on-demand derivation after a portable restore
            self.qweight, self.derive_on_first_use = self.derive_on_first_use(self.qweight), None
        absmax = x.float().abs().amax(dim=-1)
        if self.parallel == "row":  # quantize as if this rank held the whole input row
            absmax = tp.all_reduce(absmax, op="max")
        xq, xscale = quant.quantize_per_token(x, absmax)
        k_pad = self.qweight.shape[1] * nz.M0
        if k_pad != self.in_features:
            xq = F.pad(xq, (0, k_pad - self.in_features))
        acc = torch.cat([quant.int8_matmul(xq, s) for s in nz.strips(self.qweight)], dim=1)
        acc = acc[:, :self.out_features]
        if self.parallel == "row":  # exact integer sum: the same result as one rank
            acc = tp.all_reduce(acc)
        return (acc.float() * xscale[:, None] * self.wscale[None, :]).to(x.dtype)

    def state_meta(self) -> dict[str, TensorMeta]:
        if not self.is_quantized:
            return {"weight": TensorMeta(Role.PARAMETER, "nd", self.shard)}
        # the per-output-channel scale covers the output rows this rank computes
        scale_rows = self.shard if self.parallel == "column" else None
        nd = (self.in_features, self.out_features)  # qweight is the NZ form of the int8 weight.T
        return {"qweight": TensorMeta(Role.DERIVED, "nz", self.shard, nd_shape=nd),
                "wscale": TensorMeta(Role.DERIVED, "nd", scale_rows)}
