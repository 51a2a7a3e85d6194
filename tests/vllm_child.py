"""Real vLLM starts in a child process, for tests/test_vllm_hooks.py and bench/vllm_start.py.

    python vllm_child.py SPEC_JSON

SPEC: {"runs": [RUN, ...], "prompts": [[ids]], "max_tokens": N, "in_process": bool}
RUN:  {"name", "model", "load_format": "auto"|"podsnap", "extra": {...}, "extension": bool,
       "rpc": [[method, [args]], ...], "eager": bool (default true: no torch.compile), "tp": int,
       "damage_copy_of": STORE (first copy STORE to extra.store and flip a byte of the largest blob of
                                each snapshot of this model there)}

Each run starts ``vllm.LLM`` (CPU; no tokenizer), generates greedily, calls
the worker-extension methods in ``rpc`` and generates again, then shuts the
engine down; one line ``RESULT {json}`` per run. With ``in_process`` (engine
core and worker in this process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the
``uni`` executor) spies wrapped around vLLM's own loading and post-processing
functions count their calls (and time them) per run; otherwise vLLM runs its
usual processes and only the loader's report comes back (through the worker
extension's ``podsnap_status``). The
podsnap loader is not imported here: vLLM finds it through the
``vllm.general_plugins`` entry point, as in production.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import sys
import time
from collections import Counter

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
COUNTS: Counter = Counter()
SECONDS: Counter = Counter()

# (module, owner attribute path, counter key): what runs when vLLM reads or post-processes weights
SPIED = [
    ("vllm.model_executor.model_loader.default_loader", "DefaultModelLoader.load_weights", "load_weights"),
    ("vllm.model_executor.model_loader.default_loader", "safetensors_weights_iterator", "checkpoint_reads"),
    ("vllm.model_executor.model_loader.base_loader", "process_weights_after_loading", "process_weights_after_loading"),
    ("vllm.model_executor.layers.linear", "UnquantizedLinearMethod.process_weights_after_loading",
     "linear_postprocess"),
    ("vllm.model_executor.layers.vocab_parallel_embedding", "UnquantizedEmbeddingMethod.process_weights_after_loading",
     "embedding_postprocess"),
    ("vllm.model_executor.layers.utils", "dispatch_cpu_unquantized_gemm", "cpu_gemm_dispatch"),
    ("podsnap.engine.checkpoint", "CheckpointReader.read", "podsnap_checkpoint_reads"),
    ("vllm.v1.worker.cpu_model_runner", "CPUModelRunner.load_model", "load_model"),
]


def install_spies() -> None:
    import importlib

    for module_name, path, key in SPIED:
        owner = importlib.import_module(module_name)
        *parents, attr = path.split(".")
        for p in parents:
            owner = getattr(owner, p)
        real = getattr(owner, attr)

        def spy(*args, _real=real, _key=key, **kwargs):
            COUNTS[_key] += 1
            t = time.perf_counter()
            try:
                return _real(*args, **kwargs)
            finally:
                SECONDS[_key] += time.perf_counter() - t

        setattr(owner, attr, spy)


def report(worker):
    r = getattr(worker.model_runner.get_model(), "podsnap_report", None)
    return None if r is None else dict(vars(r))


def loader_report(llm, run: dict, spec: dict):
    """What the podsnap loader did (a function runs in the worker only in process; else the extension asks)."""
    if run.get("extension"):
        return llm.collective_rpc("podsnap_status")[0]["report"]
    return llm.collective_rpc(report)[0] if spec.get("in_process") else None


def generate(llm, prompts, max_tokens):
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def damaged_copy(source: str, store_dir: str, model: str) -> None:
    from podsnap.snapshot.store import Store

    shutil.copytree(source, store_dir)
    store = Store(store_dir, create=False)
    blobs = {max(m.ranks[0].tensors, key=lambda r: r.length).blob for m in store.manifests()
             if m.extras.get("source") == model}
    for digest in blobs:
        path = store.blob_path(digest)
        data = bytearray(path.read_bytes())
        data[0] ^= 0xFF
        path.write_bytes(bytes(data))


def run_one(run: dict, spec: dict) -> dict:
    from vllm import LLM

    if run.get("damage_copy_of"):
        damaged_copy(run["damage_copy_of"], run["extra"]["store"], run["model"])

    kwargs = {"load_format": run.get("load_format", "auto")}
    if run.get("extra") is not None:
        kwargs["model_loader_extra_config"] = run["extra"]
    if run.get("extension"):
        kwargs["worker_extension_cls"] = "podsnap.engine_hooks.worker.PodsnapWorkerExtension"
    if spec.get("in_process"):
        kwargs["distributed_executor_backend"] = "uni"
    COUNTS.clear()
    SECONDS.clear()
    out: dict = {"name": run.get("name")}
    t = time.perf_counter()
    try:
        llm = LLM(model=run["model"], skip_tokenizer_init=True, gpu_memory_utilization=0.2, max_model_len=256,
                  enforce_eager=run.get("eager", True), seed=0, tensor_parallel_size=run.get("tp", 1), **kwargs)
    except Exception as e:  # noqa: BLE001 - the test reads the message
        out.update(error=f"{type(e).__name__}: {e}", counts=dict(COUNTS))
        return out
    out["init_s"] = time.perf_counter() - t
    out["counts"], out["seconds"] = dict(COUNTS), dict(SECONDS)
    out["report"] = loader_report(llm, run, spec)
    out["tokens"] = generate(llm, spec["prompts"], spec["max_tokens"])
    if run.get("rpc"):
        out["rpc"] = [llm.collective_rpc(method, args=tuple(args))[0] for method, args in run["rpc"]]
        out["tokens_after"] = generate(llm, spec["prompts"], spec["max_tokens"])
    shutdown(llm)
    return out


def shutdown(llm) -> None:
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    destroy_model_parallel()
    destroy_distributed_environment()


def main(spec_json: str) -> int:
    spec = json.loads(spec_json)
    if spec.get("in_process"):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        install_spies()
    for run in spec["runs"]:
        print("RESULT " + json.dumps(run_one(run, spec)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
