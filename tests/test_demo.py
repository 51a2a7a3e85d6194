"""`podsnap demo`, the main job, end to end (tiny preset to keep it quick)."""

from __future__ import annotations

from podsnap.demo import run_demo


def test_demo_restores_identical_tokens_and_writes_a_chart(tmp_path):
    result = run_demo(tmp_path, preset="tiny", quant="w8a8")
    assert result["identical"] and result["tokens"] == result["restored_tokens"]
    assert result["cold_start"]["postprocess"] > 0 and result["restore"]["postprocess"] == 0
    assert result["restore"]["restored"] is True
    png = tmp_path / "demo.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
