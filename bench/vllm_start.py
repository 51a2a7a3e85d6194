"""vLLM engine start: plain checkpoint load vs podsnap restore, side by side in one run.

For one model (default llama/small; ``--preset 1g`` for a ~1 GiB checkpoint):

- plain:            ``LLM(model)``: vLLM reads the checkpoint and post-processes it;
- podsnap, first:   ``LLM(model, load_format="podsnap")`` on an empty store: the same,
                    plus the fingerprint (hashing the checkpoint) and writing the snapshot;
- podsnap, restore: the same call again: a meta-built model filled from the store;
                    vLLM's load_weights and process_weights_after_loading do not run.

Every start is a fresh vLLM engine in its own child process (tests/vllm_child.py),
with the page cache of the checkpoint and the store dropped first (``--cache
warm`` keeps it). Plain and restore alternate ``--repeat`` times; medians are
printed. "engine init" is the ``LLM(...)`` constructor (model load, KV cache,
warm-up); "model load" is the worker's ``load_model``, and of that, "CPU GEMM
dispatch" is vLLM building its oneDNN handles, which a restore reruns (the one
post-processing product that is not a tensor). Both are in-process mode only:
vLLM's engine core and worker run in the child itself, so they can be timed;
``--multiproc`` uses vLLM's usual processes and times the constructor only.

    python bench/vllm_start.py [--preset small|1g] [--repeat 3] [--cache cold|warm] [--multiproc]
                               [--verify full|sample|none]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from common import DEFAULT_WORKDIR, bench_model, drop_page_cache, print_rows

CHILD = Path(__file__).resolve().parents[1] / "tests" / "vllm_child.py"
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8]]


def start(model: Path, store: Path | None, multiproc: bool, verify: str) -> dict:
    run = {"name": "run", "model": str(model), "load_format": "auto"}
    if store is not None:
        run.update(load_format="podsnap", extra={"store": str(store), "verify": verify}, extension=multiproc)
    spec = {"in_process": not multiproc, "prompts": PROMPTS, "max_tokens": 4, "runs": [run]}
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run([sys.executable, str(CHILD), json.dumps(spec)], capture_output=True, text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.exit(f"vLLM start failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    result = json.loads(lines[0].removeprefix("RESULT "))
    if "error" in result:
        sys.exit(f"vLLM start failed: {result['error']}")
    return result


def drop(paths: list[Path]) -> None:
    drop_page_cache([p for p in paths if p.is_file()])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small", choices=["small", "1g"])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cache", default="cold", choices=["cold", "warm"])
    ap.add_argument("--multiproc", action="store_true", help="vLLM's usual engine-core and worker processes")
    ap.add_argument("--verify", default="full", choices=["full", "sample", "none"], help="podsnap's hash check")
    args = ap.parse_args()
    model = bench_model("llama", args.preset)
    store = DEFAULT_WORKDIR / f"vllm-store-{args.preset}"
    shutil.rmtree(store, ignore_errors=True)  # the first podsnap start finds an empty store
    files = lambda: [*model.glob("*.safetensors"), *store.rglob("blobs/*/*")]  # noqa: E731

    def measured(path: str, with_store: bool) -> dict:
        if args.cache == "cold":
            drop(files())
        r = start(model, store if with_store else None, args.multiproc, args.verify)
        mode = (r.get("report") or {}).get("mode", "plain")
        print(f"  {path:<17} engine init {r['init_s']:7.2f} s   ({mode})", flush=True)
        return r

    print(f"llama/{args.preset}: {sum(f.stat().st_size for f in model.glob('*.safetensors')) / 2**20:.0f} MiB "
          f"checkpoint, page cache {args.cache}, {'multiproc' if args.multiproc else 'in-process'} vLLM")
    first = measured("podsnap, first", True)
    runs: dict[str, list[dict]] = {"plain": [], "podsnap, restore": []}
    tokens = {json.dumps(first["tokens"])}
    for _ in range(args.repeat):
        for path in runs:
            r = measured(path, path != "plain")
            runs[path].append(r)
            tokens.add(json.dumps(r["tokens"]))
    assert all(r["report"]["mode"] == "restored" for r in runs["podsnap, restore"] if r.get("report"))

    def row(path: str, rs: list[dict]) -> list:
        def med(key: str) -> str:
            values = [r["seconds"][key] for r in rs if key in r.get("seconds", {})]
            return f"{statistics.median(values):.3f}" if values else "n/a"

        return [path, len(rs), f"{statistics.median(r['init_s'] for r in rs):.2f}", med("load_model"),
                med("cpu_gemm_dispatch")]

    rows = [row("plain", runs["plain"]), row("podsnap, first", [first]),
            row("podsnap, restore", runs["podsnap, restore"])]
    print_rows("seconds (median)", ["path", "starts", "engine init", "model load", "of which CPU GEMM dispatch"],
               rows)
    plain, restore = float(rows[0][2]), float(rows[2][2])
    print(f"\nengine init: plain / podsnap restore = {plain / restore:.2f}x; greedy tokens identical across all "
          f"starts: {len(tokens) == 1}")
    if rows[0][3] != "n/a":
        print(f"model load:  plain / podsnap restore = {float(rows[0][3]) / float(rows[2][3]):.2f}x")


if __name__ == "__main__":
    main()
