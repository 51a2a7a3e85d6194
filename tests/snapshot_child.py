"""A snapshot writer in its own process, for the crash and concurrency tests.

    python snapshot_child.py MODEL_DIR STORE NAME KV_SEED

Cold-starts the model (w8a8), fills the KV cache from KV_SEED (so the blobs
are new), prints "ready", waits for a line on stdin, prints "writing",
snapshots with KV and prints "done SECONDS". Exit 3 on a store error.
"""

from __future__ import annotations

import sys
import time

import torch

from podsnap.engine.llm_engine import EngineOptions, LLMEngine
from podsnap.snapshot.capture import snapshot_engine
from podsnap.snapshot.store import StoreError


def main(model_dir: str, store: str, name: str, kv_seed: str) -> int:
    engine = LLMEngine.cold_start(model_dir, EngineOptions(quant="w8a8"))
    torch.manual_seed(int(kv_seed))
    engine.kv_cache.k.normal_()
    print("ready", flush=True)
    sys.stdin.readline()
    print("writing", flush=True)
    t = time.perf_counter()
    try:
        snapshot_engine(engine, store, name, with_kv=True)
    except StoreError as e:
        print(f"store error: {e}", flush=True)
        return 3
    print(f"done {time.perf_counter() - t:.6f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
