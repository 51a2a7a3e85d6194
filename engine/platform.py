"""The platform decides every device-specific conversion of post-processing.

Post-processing turns checkpoint tensors into device state: W8A8 int8 weights
in the device's matmul layout with their scales, RoPE cos/sin tables and the
causal mask cache. It is the expensive, deterministic part of a cold start
that a restore skips, so it lives in one place, and ``postprocess_calls``
counts how often it ran (restore tests assert it stays at zero).

``cpu`` is the platform that runs here. An ``ascend`` platform would make the
same decisions with ``torch_npu.npu_format_cast(w, 29)`` for the NZ cast.
"""

from __future__ import annotations

import torch

from podsnap.errors import ConfigError

from . import nz, quant, tp


class CpuPlatform:
    name = "cpu"
    weight_layout = "nz"  # the layout W8A8 weights are kept in

    def __init__(self) -> None:
        self.postprocess_calls = 0

    def postprocess(self, model, quant: str) -> None:
        """Turn a freshly loaded ``CausalLM`` into device state (in place)."""
        self.postprocess_calls += 1
        if quant == "w8a8":
            for linear in model.linears():
                if linear.quantizable:
                    linear.set_quantized(*self.quantize_linear(linear.weight, self._row_absmax(linear)))
        cfg = model.cfg
        model.rope_cos, model.rope_sin = self.rope_tables(cfg.head_dim, cfg.rope_theta,
                                                          cfg.max_position_embeddings)
        model.attn_mask = self.causal_mask(cfg.max_position_embeddings)

    @staticmethod
    def _row_absmax(linear) -> torch.Tensor | None:
        """Per-output-row max |w| over the whole input dim, for a row-parallel shard."""
        if linear.parallel != "row":
            return None
        return tp.all_reduce(linear.weight.float().abs().amax(dim=1), op="max")

    def quantize_linear(self, weight: torch.Tensor,
                        row_absmax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, in)`` float weight -> (int8 NZ of ``weight.T``, fp32 per-out-channel scale).

        ``row_absmax`` is the max |w| of each output row over the *unsharded*
        input dimension, for a rank that holds only some columns.
        """
        q, scale = quant.quantize_per_channel(weight.float(), row_absmax)
        return self.to_device_layout(q.t()), scale

    @staticmethod
    def to_device_layout(nd: torch.Tensor) -> torch.Tensor:
        """The matmul layout this device wants for an int8 ``(in, out)`` weight: FRACTAL_NZ."""
        return nz.nd_to_nz(nd)

    @property
    def layout_tag(self) -> str:
        return f"{self.name}/{self.weight_layout}"

    @staticmethod
    def rope_tables(head_dim: int, theta: float, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``(max_positions, head_dim)`` in fp32, halves duplicated (HF rotate_half style)."""
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()

    @staticmethod
    def causal_mask(max_positions: int) -> torch.Tensor:
        """``mask[q, k]`` is True where query position q may attend to key position k."""
        return torch.ones(max_positions, max_positions, dtype=torch.bool).tril()


PLATFORMS = {"cpu": CpuPlatform}


def get_platform(name: str = "cpu") -> CpuPlatform:
    if name not in PLATFORMS:
        raise ConfigError(f"platform {name!r} is not available here; available: {', '.join(PLATFORMS)}")
    return PLATFORMS[name]()
