"""W8A8: int8 weights with per-output-channel scales, int8 activations per token.

    w_int8[o, :] = round(w[o, :] / s_w[o]),  s_w[o] = max|w[o, :]| / 127
    x_int8[t, :] = round(x[t, :] / s_x[t]),  s_x[t] = max|x[t, :]| / 127
    y[t, o]      = (sum_k x_int8[t, k] * w_int8[o, k]) * s_x[t] * s_w[o]

The sum runs in int32 (exact). ``torch._int_mm`` does it where the CPU build
supports it; ``INT_MM_PATH`` says which path runs.
"""

from __future__ import annotations

import torch

QMAX = 127


def quantize_per_channel(w: torch.Tensor,
                         absmax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` ``(out, in)`` float -> (int8 ``(out, in)``, fp32 scale ``(out,)``).

    ``absmax`` overrides the per-row max (for a column shard of a larger weight).
    """
    w = w.float()
    if absmax is None:
        absmax = w.abs().amax(dim=1)
    scale = (absmax / QMAX).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-QMAX, QMAX).to(torch.int8)
    return q, scale


def quantize_per_token(x: torch.Tensor, absmax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``(t, k)`` -> (int8 ``(t, k)``, fp32 scale ``(t,)``).

    ``absmax`` overrides the per-token max (tensor parallelism passes the max
    over all ranks so every rank quantizes as a single rank would).
    """
    x = x.float()
    if absmax is None:
        absmax = x.abs().amax(dim=1)
    scale = (absmax / QMAX).clamp(min=1e-12)
    return torch.round(x / scale[:, None]).clamp(-QMAX, QMAX).to(torch.int8), scale


def _probe_int_mm() -> str:
    try:
        a = torch.ones((17, 32), dtype=torch.int8)
        b = torch.ones((32, 32), dtype=torch.int8)
        ok = bool((torch._int_mm(a, b) == 32).all())
        return "torch._int_mm" if ok else "int32 matmul (torch._int_mm gave wrong results)"
    except (RuntimeError, AttributeError):
        return "int32 matmul (torch._int_mm unavailable on this build)"


INT_MM_PATH = _probe_int_mm()


def int8_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """int8 ``(m, k)`` @ int8 ``(k, n)`` -> int32 ``(m, n)``, exact."""
    if INT_MM_PATH == "torch._int_mm":
        return torch._int_mm(a, b)
    return (a.to(torch.int32) @ b.to(torch.int32))
