"""FRACTAL_NZ layout and W8A8 quantization."""

from __future__ import annotations

import pytest
import torch

from podsnap.engine import nz, quant
from podsnap.engine.layers import Linear
from podsnap.engine.llm_engine import EngineOptions, LLMEngine
from podsnap.engine.platform import CpuPlatform


@pytest.mark.parametrize("shape", [(1, 1), (15, 33), (16, 32), (17, 31), (100, 7), (64, 176)])
@pytest.mark.parametrize("dtype", [torch.int8, torch.bfloat16, torch.float32])
def test_nz_round_trip_is_exact_with_padding(shape, dtype):
    nd = (torch.randn(shape) * 50).to(dtype)
    packed = nz.nd_to_nz(nd)
    m, n = shape
    n0 = nz.n0_for(dtype)
    assert packed.shape == (-(-n // n0), -(-m // 16), 16, n0)
    assert torch.equal(nz.nz_to_nd(packed, m, n), nd)
    # padding is zero and every element sits where the layout says
    i, j = m - 1, n - 1
    assert packed[j // n0, i // 16, i % 16, j % n0] == nd[i, j]
    assert torch.count_nonzero(packed) == torch.count_nonzero(nd)  # the padding is all zeros


def test_nz_strips_are_contiguous_column_blocks():
    nd = torch.arange(40 * 70, dtype=torch.float32).view(40, 70)
    strips = nz.strips(nz.nd_to_nz(nd))
    assert all(s.is_contiguous() for s in strips)
    assert torch.equal(strips[1][:40, :8], nd[:, 8:16])


def test_int8_matmul_from_nz_is_exact():
    a = torch.randint(-127, 128, (9, 48), dtype=torch.int8)
    b = torch.randint(-127, 128, (48, 70), dtype=torch.int8)
    exact = a.to(torch.int64) @ b.to(torch.int64)
    packed = nz.nd_to_nz(b)
    got = torch.cat([quant.int8_matmul(a, s) for s in nz.strips(packed)], dim=1)[:, :70]
    assert torch.equal(got.to(torch.int64), exact)


def test_w8a8_linear_is_close_to_float():
    torch.manual_seed(0)
    layer = Linear(63, 45, "w")
    layer.weight = torch.nn.Parameter(torch.randn(45, 63) * 0.05, requires_grad=False)
    x = torch.randn(7, 63)
    ref = layer(x)
    layer.set_quantized(*CpuPlatform().quantize_linear(layer.weight))
    rel = ((layer(x) - ref).norm() / ref.norm()).item()
    assert layer.weight is None and layer.qweight.dtype == torch.int8
    assert rel < 0.02, f"W8A8 linear relative error {rel:.4f}"  # measured ~0.008


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3-moe"])
def test_w8a8_model_logits_stay_close(model_factory, arch):
    """Measured relative L2 logit error of W8A8 vs unquantized on the tiny presets: 1.3-1.6%."""
    model_dir = model_factory(arch)
    logits = {}
    for q in ("none", "w8a8"):
        engine = LLMEngine.cold_start(model_dir, EngineOptions(quant=q))
        engine.add_request([1, 2, 3, 4, 5, 6], 1)
        seqs, _ = engine.scheduler.schedule()
        logits[q] = engine.forward(seqs, last_only=False)
    rel = ((logits["w8a8"] - logits["none"]).norm() / logits["none"].norm()).item()
    assert 0 < rel < 0.03, f"{arch}: W8A8 relative logit error {rel:.4f}"
    assert torch.equal(logits["w8a8"][0].argmax(), logits["none"][0].argmax())
