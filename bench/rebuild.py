"""Group rebuild latency on gloo: teardown, rendezvous, group creation.

For TP=2 and TP=4 (one process per rank, loopback), the group is rebuilt
``--rounds`` times: every rank tears down generation g, then generation g+1
meets at its rendezvous (incremental port policy) and the groups are
created; an all-reduce checks the new group. Printed: the median of each
phase on rank 0 and of the whole rebuild. Process start, model restore and
warm-up are not in these figures (a restored rank does those before it joins).

    python bench/rebuild.py [--rounds 15] [--tp 2 4]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from common import print_rows

from podsnap.comm_rebuild import groups
from podsnap.engine.launch import free_port, run_on_ranks


def rebuild_rounds(rank: int, world: int, base: int, rounds: int) -> list[dict]:
    out = []
    for generation in range(1, rounds + 1):
        t = time.perf_counter()
        teardown = groups.teardown()
        joined = groups.join("127.0.0.1", base, generation, rank, world, timeout_s=60)
        x = torch.ones(1)
        dist.all_reduce(x)
        assert x.item() == world
        out.append({"teardown": teardown, **joined.to_dict(), "total": time.perf_counter() - t})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    args = ap.parse_args()
    rows = []
    for tp in args.tp:
        base = 20000 + free_port() % 30000
        rounds = run_on_ranks(rebuild_rounds, tp, base, args.rounds)
        med = {k: statistics.median(r[k] for r in rounds) for k in ("teardown", "rendezvous", "groups", "total")}
        rows.append([tp, args.rounds, *(f"{med[k] * 1000:.1f}" for k in ("teardown", "rendezvous", "groups",
                                                                           "total"))])
    print_rows("median rebuild latency on rank 0 (ms, gloo, loopback)",
               ["tp", "rounds", "teardown", "rendezvous", "group creation", "total"], rows)


if __name__ == "__main__":
    main()
