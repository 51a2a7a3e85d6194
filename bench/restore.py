"""Cold start vs warm restore, and restore reads vs a raw read of the same bytes.

In one run, for one model (default llama/1g, W8A8):

- cold start: read the HF checkpoint + post-process + first token;
- warm restore from the store to the first token (verify none and full);
- a raw sequential read of exactly the restored blobs from the same store.

Each is measured with the page cache dropped first (posix_fadvise DONTNEED
on every file involved: "cold") and again with the files cached ("warm").
Printed ratios: cold start / restore, and restore-read throughput / raw-read
throughput (the >= 90% goal).

    python bench/restore.py [--preset 1g] [--arch llama] [--quant w8a8] [--mode read|mmap]
"""

from __future__ import annotations

import argparse
import time

from common import DEFAULT_WORKDIR, bench_model, drop_page_cache, print_rows, raw_sequential_read

from podsnap.engine.llm_engine import EngineOptions, LLMEngine
from podsnap.restore.warm import warm_start
from podsnap.snapshot.capture import snapshot_engine
from podsnap.snapshot.store import Store

PROMPT = [[1, 2, 3, 4, 5, 6, 7, 8]]


def first_token(engine: LLMEngine) -> float:
    t = time.perf_counter()
    engine.generate(PROMPT, max_tokens=1)
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="llama", choices=["llama", "qwen3", "qwen3-moe"])
    ap.add_argument("--preset", default="1g", choices=["tiny", "small", "1g"])
    ap.add_argument("--quant", default="w8a8", choices=["none", "w8a8"])
    ap.add_argument("--mode", default="read", choices=["read", "mmap"])
    args = ap.parse_args()
    model_dir = bench_model(args.arch, args.preset)
    checkpoint = sorted(model_dir.glob("*.safetensors"))
    store_dir = DEFAULT_WORKDIR / "restore-store"
    name = f"{args.arch}-{args.preset}-{args.quant}"

    rows, ratios = [], []
    for cache in ("cold", "warm"):
        if cache == "cold":
            drop_page_cache(checkpoint)
        t = time.perf_counter()
        engine = LLMEngine.cold_start(model_dir, EngineOptions(quant=args.quant))
        ft = first_token(engine)
        cold_total = time.perf_counter() - t
        tm = engine.timings
        rows.append([cache, "cold start", f"{tm.load:.3f}", f"{tm.postprocess:.3f}", f"{ft:.3f}",
                     f"{cold_total:.3f}", "", ""])
        store = Store(store_dir)
        if name not in store.list_ids():
            snapshot_engine(engine, store_dir, name)
        del engine
        blobs = sorted({store.blob_path(t.blob) for t in store.load(name).ranks[0].tensors})
        size = sum(b.stat().st_size for b in blobs)
        for verify in ("none", "full"):
            if cache == "cold":
                drop_page_cache(blobs)
            t = time.perf_counter()
            restored = warm_start(store_dir, name, verify=verify, load_mode=args.mode)
            ft = first_token(restored)
            total = time.perf_counter() - t
            load = restored.restored_from.load
            if cache == "cold":
                drop_page_cache(blobs)
            t = time.perf_counter()
            raw_bytes = raw_sequential_read(blobs)
            raw = time.perf_counter() - t
            assert raw_bytes == size == load.bytes
            rows.append([cache, f"restore ({args.mode}, verify {verify})", f"{restored.timings.load:.3f}", "0",
                         f"{ft:.3f}", f"{total:.3f}", f"{size / load.seconds / 2**20:.0f}",
                         f"{size / raw / 2**20:.0f}"])
            ratios.append((cache, verify, cold_total / total, raw / load.seconds))
            del restored

    print(f"model {args.arch}/{args.preset} quant={args.quant}; checkpoint "
          f"{sum(f.stat().st_size for f in checkpoint) / 2**30:.2f} GiB, snapshot {size / 2**30:.2f} GiB")
    print_rows("seconds to first token", ["cache", "path", "load/read", "postprocess", "first token", "total",
                                          "restore MiB/s", "raw MiB/s"], rows)
    print()
    for cache, verify, speedup, read_ratio in ratios:
        lazy = args.mode == "mmap" and verify == "none"  # nothing is read until a page is touched
        print(f"{cache:>4} cache, verify {verify:>4}: cold start / restore = {speedup:5.2f}x   "
              "restore read / raw read throughput = "
              + ("n/a (mmap is lazy: pages are read on first touch)" if lazy else f"{read_ratio:6.1%}"))


if __name__ == "__main__":
    main()
