"""Functions that spawned rank processes run in tests (they must be importable by name)."""

from __future__ import annotations


def create_on_ranks(rank, world, start, store, name, with_kv=False):
    from podsnap.snapshot.capture import snapshot_engine

    done = snapshot_engine(start(rank, world), store, name, with_kv)
    return None if done is None else done[0].snapshot_id
