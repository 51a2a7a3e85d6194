"""Reading HF checkpoints by byte range, making tiny ones, and the errors on bad input."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from podsnap.engine.checkpoint import CheckpointReader
from podsnap.engine.config import ModelConfig
from podsnap.engine.llm_engine import LLMEngine
from podsnap.engine.tiny import hf_tensor_shapes, make_tiny
from podsnap.errors import CheckpointError, ConfigError


def test_reader_matches_safetensors_and_reads_row_ranges(model_factory):
    model_dir = model_factory("qwen3")
    reference = load_file(str(model_dir / "model.safetensors"))
    reader = CheckpointReader(model_dir)
    for name, tensor in reference.items():
        assert torch.equal(reader.read(name), tensor), name
    q = "model.layers.1.self_attn.q_proj.weight"
    before = reader.bytes_read
    rows = reader.read(q, rows=(16, 40))
    assert torch.equal(rows, reference[q][16:40])
    assert reader.bytes_read - before == rows.numel() * rows.element_size()  # only those bytes were read


def test_sharded_checkpoint_gives_same_tokens(model_factory):
    one, three = model_factory("llama"), model_factory("llama", shards=3)
    index = json.loads((three / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3
    prompt = [[5, 6, 7]]
    assert LLMEngine.cold_start(one).generate(prompt, 6) == LLMEngine.cold_start(three).generate(prompt, 6)


def test_make_tiny_is_deterministic(tmp_path):
    make_tiny("qwen3-moe", tmp_path / "a", seed=3)
    make_tiny("qwen3-moe", tmp_path / "b", seed=3)
    make_tiny("qwen3-moe", tmp_path / "c", seed=4)
    a, b, c = ((tmp_path / d / "model.safetensors").read_bytes() for d in "abc")
    assert a == b and a != c
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"] and cfg["num_experts"] == 8
    assert set(load_file(str(tmp_path / "a" / "model.safetensors"))) == set(
        hf_tensor_shapes(ModelConfig.load(tmp_path / "a")))


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        LLMEngine.cold_start(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="config.json"):
        LLMEngine.cold_start(tmp_path)


def copy_model(model_factory, tmp_path, arch="llama"):
    dst = tmp_path / "model"
    shutil.copytree(model_factory(arch), dst)
    return dst


def rewrite_weights(model_dir, edit):
    from safetensors.torch import save_file

    tensors = load_file(str(model_dir / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(model_dir / "model.safetensors"))


def test_missing_tensor_is_named(model_factory, tmp_path):
    model_dir = copy_model(model_factory, tmp_path)
    rewrite_weights(model_dir, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"'model.layers.1.mlp.up_proj.weight' is missing"):
        LLMEngine.cold_start(model_dir)


def test_shape_mismatch_names_both_shapes(model_factory, tmp_path):
    model_dir = copy_model(model_factory, tmp_path)

    def shrink(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:16]

    rewrite_weights(model_dir, shrink)
    with pytest.raises(CheckpointError, match=r"k_proj.weight.*shape \[16, 64\].*expects \[32, 64\]"):
        LLMEngine.cold_start(model_dir)


def test_unsupported_architecture(model_factory, tmp_path):
    model_dir = copy_model(model_factory, tmp_path)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="MambaForCausalLM.*supported: LlamaForCausalLM"):
        LLMEngine.cold_start(model_dir)


def test_corrupt_safetensors_header(model_factory, tmp_path):
    model_dir = copy_model(model_factory, tmp_path)
    (model_dir / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(CheckpointError, match="safetensors header"):
        LLMEngine.cold_start(model_dir)


def test_truncated_safetensors(model_factory, tmp_path):
    model_dir = copy_model(model_factory, tmp_path)
    path = model_dir / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="does not match shape"):
        LLMEngine.cold_start(model_dir)
