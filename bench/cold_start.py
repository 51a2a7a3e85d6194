"""Cold-start breakdown of the reference engine: read, post-process, first token.

Runs, in one process and side by side, a raw sequential read of the
checkpoint files (the storage baseline) and full cold starts with quant
none and w8a8, each with the page cache dropped first (cold) and again with
the files cached (warm). Prints seconds per phase and the ratios.

    python bench/cold_start.py [--preset 1g] [--arch llama]
"""

from __future__ import annotations

import argparse
import time

import torch
from common import bench_model, drop_page_cache, print_rows, raw_sequential_read, timed

from podsnap.engine.llm_engine import EngineOptions, LLMEngine


def cold_start(model_dir, quant: str) -> dict:
    t = time.perf_counter()
    engine = LLMEngine.cold_start(model_dir, EngineOptions(quant=quant))
    engine.generate([[1, 2, 3, 4, 5, 6, 7, 8]], max_tokens=1)
    tm = engine.timings
    return {"read": tm.load, "postprocess": tm.postprocess, "first_token": tm.first_token,
            "total": time.perf_counter() - t}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="llama", choices=["llama", "qwen3", "qwen3-moe"])
    ap.add_argument("--preset", default="1g", choices=["tiny", "small", "1g"])
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model_dir = bench_model(args.arch, args.preset)
    files = sorted(model_dir.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    print(f"model {args.arch}/{args.preset}: {size / 2**30:.2f} GiB in {len(files)} file(s), "
          f"{torch.get_num_threads()} threads")

    rows, raw = [], {}
    for cache in ("cold", "warm"):
        if cache == "cold":
            drop_page_cache(files)
        with timed(raw, cache):
            raw_sequential_read(files)
        for quant in ("none", "w8a8"):
            if cache == "cold":
                drop_page_cache(files)
            r = cold_start(model_dir, quant)
            rows.append([cache, quant, *(f"{r[k]:.3f}" for k in ("read", "postprocess", "first_token", "total")),
                         f"{size / r['read'] / 2**20:.0f}", f"{raw[cache] / r['read']:.2f}",
                         f"{(r['read'] + r['postprocess']) / r['total']:.0%}"])
    print_rows("cold start (seconds)",
               ["cache", "quant", "read", "postprocess", "first_token", "total", "read MiB/s",
                "raw-read/read", "read+pp share"], rows)
    print_rows("raw sequential read of the same files (baseline)", ["cache", "seconds", "MiB/s"],
               [[c, f"{t:.3f}", f"{size / t / 2**20:.0f}"] for c, t in raw.items()])
    print("\nread+pp share = fraction of the cold start a podsnap restore skips (read + post-process)")


if __name__ == "__main__":
    main()
