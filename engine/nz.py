"""Ascend's FRACTAL_NZ layout, as plain tensor operations.

An ND matrix ``(m, n)`` is cut into fractals of ``16 x n0`` elements, where
``n0`` fills 32 bytes (16 for fp16/bf16, 32 for int8, 8 for fp32). Rows are
padded to a multiple of 16 and columns to a multiple of ``n0`` with zeros.
The fractals are stored column-strip major::

    nz[j, i, r, c] = nd[i * 16 + r, j * n0 + c]      shape (ceil(n/n0), ceil(m/16), 16, n0)

so each strip ``nz[j]`` — all rows of columns ``j*n0 .. j*n0+n0`` — is one
contiguous ``(m_pad, n0)`` block. A matmul ``x @ nd`` can therefore run strip
by strip straight from the NZ tensor (``x @ nz[j].view(m_pad, n0)``), which is
what the Ascend cube unit does and what our quantized linear does on CPU.
On an NPU the platform calls ``torch_npu.npu_format_cast(w, 29)`` instead.
"""

from __future__ import annotations

import torch

M0 = 16  # fractal rows
C0_BYTES = 32  # bytes in one fractal row


def n0_for(dtype: torch.dtype) -> int:
    return C0_BYTES // torch.empty((), dtype=dtype).element_size()


def nz_shape(m: int, n: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    n0 = n0_for(dtype)
    return (-(-n // n0), -(-m // M0), M0, n0)


def nd_to_nz(nd: torch.Tensor) -> torch.Tensor:
    """ND ``(m, n)`` -> NZ ``(ceil(n/n0), ceil(m/16), 16, n0)``, zero-padded."""
    if nd.dim() != 2:
        raise ValueError(f"FRACTAL_NZ needs a 2-D tensor, got shape {list(nd.shape)}")
    m, n = nd.shape
    nb, mb, _, n0 = nz_shape(m, n, nd.dtype)
    padded = torch.zeros((mb * M0, nb * n0), dtype=nd.dtype)
    padded[:m, :n] = nd
    return padded.view(mb, M0, nb, n0).permute(2, 0, 1, 3).contiguous()


def nz_to_nd(nz: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """The inverse of :func:`nd_to_nz`: drop the padding and return ``(m, n)``."""
    nb, mb, m0, n0 = nz.shape
    return nz.permute(1, 2, 0, 3).reshape(mb * m0, nb * n0)[:m, :n].contiguous()


def strips(nz: torch.Tensor) -> list[torch.Tensor]:
    """The contiguous ``(m_pad, n0)`` column strips of an NZ tensor (views, no copy)."""
    nb, mb, m0, n0 = nz.shape
    return list(nz.view(nb, mb * m0, n0).unbind(0))
