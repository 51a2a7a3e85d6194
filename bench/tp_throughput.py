"""Decode throughput of the reference engine at TP=1 and TP=2, in the same run.

Each TP size cold-starts its own group of rank processes (TP=1 in-process),
generates ``--batch`` sequences of ``--tokens`` tokens greedily and reports
decode tokens/s (decode steps only; the prefill is excluded). The ratio
TP=2 / TP=1 is printed last. All ranks share this machine's cores
(``threads_per_rank`` splits them), so the ratio shows the parallel
overhead here, not the speed-up of two accelerators.

    python bench/tp_throughput.py [--preset 1g] [--arch llama] [--quant none]
"""

from __future__ import annotations

import argparse

from common import bench_model, print_rows

from podsnap.engine.generate import generate
from podsnap.engine.launch import threads_per_rank
from podsnap.engine.llm_engine import EngineOptions


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="llama", choices=["llama", "qwen3", "qwen3-moe"])
    ap.add_argument("--preset", default="1g", choices=["tiny", "small", "1g"])
    ap.add_argument("--quant", default="none", choices=["none", "w8a8"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    model_dir = bench_model(args.arch, args.preset)
    prompts = [[(7 * i + j) % 1000 + 1 for j in range(16)] for i in range(args.batch)]
    rows, rates, tokens = [], {}, {}
    for tp in args.tp:
        r = generate(model_dir, prompts, args.tokens, EngineOptions(quant=args.quant), tp=tp)
        t = r.timings
        rates[tp], tokens[tp] = t["decode_tokens_per_s"], r.tokens
        rows.append([tp, threads_per_rank(tp), f"{t['first_token']:.3f}", f"{t['decode']:.3f}",
                     f"{t['decode_tokens_per_s']:.1f}"])
    print(f"model {args.arch}/{args.preset} quant={args.quant}, batch {args.batch} x {args.tokens} tokens")
    print_rows("decode throughput", ["tp", "threads/rank", "prefill s", "decode s", "decode tok/s"], rows)
    base = args.tp[0]
    for tp in args.tp[1:]:
        same = "identical" if tokens[tp] == tokens[base] else "DIFFERENT"
        print(f"TP={tp} / TP={base} decode throughput: {rates[tp] / rates[base]:.2f}x (tokens {same})")


if __name__ == "__main__":
    main()
