"""Filling tensors from the store: parallel chunked range reads, or zero-copy mmap.

``read`` mode cuts every blob into chunks and reads them with ``pread`` from
a thread pool straight into the destination tensors; once all chunks of a
tensor are in, its hash is checked on the same pool, so verification runs in
parallel with the remaining reads. ``mmap`` mode maps each blob privately
(copy-on-write) where the device is CPU: no copy at all, pages come in on
first touch (or during verification). KV blocks are always read, since the
engine writes them.

Verification modes: ``full`` hashes every tensor, ``sample`` one in eight
(chosen by hash, so the same ones every time), ``none`` checks sizes only.
A mismatch names the tensor and the blob file.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from podsnap.engine.checkpoint import DTYPES as _SAFETENSORS_DTYPES
from podsnap.errors import PodsnapError
from podsnap.snapshot.manifest import RankRecord, TensorRecord
from podsnap.snapshot.store import Store, hash_bytes

VERIFY_MODES = ("full", "sample", "none")
LOAD_MODES = ("read", "mmap")
CHUNK = 8 << 20
DTYPES = {str(d).removeprefix("torch."): d for d in _SAFETENSORS_DTYPES.values()}


class IntegrityError(PodsnapError):
    """A blob does not hold what the manifest says."""


@dataclass
class LoadStats:
    bytes: int = 0
    verified_bytes: int = 0
    seconds: float = 0.0


def should_verify(record: TensorRecord, mode: str) -> bool:
    if mode not in VERIFY_MODES:
        raise PodsnapError(f"verify mode {mode!r} is not one of {', '.join(VERIFY_MODES)}")
    return mode == "full" or (mode == "sample" and int(record.blob[:2], 16) % 8 == 0)


def as_tensor(raw: torch.Tensor, record: TensorRecord) -> torch.Tensor:
    if record.dtype not in DTYPES:
        raise IntegrityError(f"tensor {record.name}: unknown dtype {record.dtype!r} in the manifest")
    return raw.view(DTYPES[record.dtype]).reshape(record.shape)


def check_size(store: Store, record: TensorRecord) -> str:
    path = store.blob_path(record.blob)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise IntegrityError(f"tensor {record.name}: blob {path} is missing") from None
    if size < record.offset + record.length:
        raise IntegrityError(f"tensor {record.name}: blob {path} has {size} bytes, the manifest says "
                             f"{record.offset + record.length} (truncated)")
    return str(path)


def load_rank(store: Store, rank: RankRecord, verify: str = "full", mode: str = "read", workers: int = 8,
              progress: Callable[[int], None] | None = None) -> tuple[dict[str, torch.Tensor], LoadStats]:
    """Every tensor of one rank, by name, as CPU tensors."""
    if mode not in LOAD_MODES:
        raise PodsnapError(f"load mode {mode!r} is not one of {', '.join(LOAD_MODES)}")
    t0 = time.perf_counter()
    stats = LoadStats()
    out: dict[str, torch.Tensor] = {}
    lock = threading.Lock()

    def verify_one(record: TensorRecord, raw: torch.Tensor, path: str) -> None:
        if hash_bytes(raw.numpy()) != record.blob:
            raise IntegrityError(f"tensor {record.name}: blob {path} does not match its hash "
                                 f"{record.blob[:16]}… (corrupt)")
        with lock:
            stats.verified_bytes += record.length

    with ThreadPoolExecutor(workers) as pool:
        reads, verifications = [], []
        for record in rank.tensors:
            path = check_size(store, record)
            stats.bytes += record.length
            check = should_verify(record, verify)
            if mode == "mmap" and record.role != "kv" and record.offset == 0 and record.length:
                raw = torch.from_file(path, shared=False, size=record.length, dtype=torch.uint8)
                if progress:
                    progress(record.length)
                if check:
                    verifications.append(pool.submit(verify_one, record, raw, path))
            else:
                raw = torch.empty(record.length, dtype=torch.uint8)
                reads += read_chunks(pool, path, record, raw, check, verify_one, progress)
            out[record.name] = as_tensor(raw, record)
        for f in reads:  # a read that completes its tensor hands back that tensor's verification
            if (v := f.result()) is not None:
                verifications.append(v)
        for v in verifications:
            v.result()
    stats.seconds = time.perf_counter() - t0
    return out, stats


def read_chunks(pool, path: str, record: TensorRecord, raw: torch.Tensor, verify: bool, verify_one,
                progress) -> list:
    """Submit one pread per chunk of ``record``; the chunk that finishes it submits its verification."""
    starts = list(range(0, record.length, CHUNK)) or [0]
    remaining = [len(starts)]
    lock = threading.Lock()
    buf = raw.numpy()

    def read(start: int):
        stop = min(start + CHUNK, record.length)
        fd = os.open(path, os.O_RDONLY)
        try:
            n = os.preadv(fd, [buf[start:stop]], record.offset + start) if stop > start else 0
        finally:
            os.close(fd)
        if n != stop - start:
            raise IntegrityError(f"tensor {record.name}: short read from blob {path} ({n} of {stop - start} "
                                 "bytes; truncated?)")
        if progress:
            progress(n)
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        return pool.submit(verify_one, record, raw, path) if last and verify else None

    return [pool.submit(read, s) for s in starts]
