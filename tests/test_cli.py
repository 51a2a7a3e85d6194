"""The podsnap command line, as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from click.testing import CliRunner

from podsnap.cli import main
from podsnap.engine.llm_engine import LLMEngine


def run(*args):
    return CliRunner().invoke(main, list(args))


def test_generate_json_matches_engine(model_factory):
    model_dir = model_factory("qwen3")
    r = run("generate", "--model", str(model_dir), "--prompt-ids", "1,2,3", "--max-tokens", "6", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["tokens"] == LLMEngine.cold_start(model_dir).generate([[1, 2, 3]], 6)[0]
    assert set(out["timings"]) >= {"load", "postprocess", "first_token", "total"}


def test_make_tiny_cli(tmp_path):
    r = run("model", "make-tiny", "--arch", "qwen3", "--out", str(tmp_path / "m"), "--shards", "2", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert "model.safetensors.index.json" in out["files"] and out["config"]["architectures"] == ["Qwen3ForCausalLM"]


def test_invalid_prompt_ids(model_factory):
    r = run("generate", "--model", str(model_factory("llama")), "--prompt-ids", "1,two,3")
    assert r.exit_code == 2 and "'two' is not an integer" in r.output


def test_errors_are_one_line_without_traceback(tmp_path):
    r = run("generate", "--model", str(tmp_path / "missing"), "--prompt-ids", "1")
    assert r.exit_code == 2
    assert "does not exist" in r.output and "Traceback" not in r.output


def test_unknown_arch_is_rejected(tmp_path):
    r = run("model", "make-tiny", "--arch", "gpt2", "--out", str(tmp_path))
    assert r.exit_code == 2 and "'gpt2' is not one of" in r.output


def test_console_script_runs_end_to_end(model_factory):
    """The installed `podsnap` entry point, in a separate process."""
    exe = os.path.join(os.path.dirname(sys.executable), "podsnap")
    out = subprocess.run([exe, "generate", "--model", str(model_factory("llama")), "--prompt-ids", "4,5",
                          "--max-tokens", "3", "--json"], capture_output=True, text=True, timeout=120, check=True)
    assert len(json.loads(out.stdout)["tokens"]) == 3
