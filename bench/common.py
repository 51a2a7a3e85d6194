"""Helpers the benchmarks share: cached bench models, page-cache control, timing."""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from pathlib import Path

from podsnap.engine.tiny import make_tiny

DEFAULT_WORKDIR = Path(os.environ.get("PODSNAP_BENCH_DIR", Path.home() / ".cache" / "podsnap-bench"))


def bench_model(arch: str, preset: str, workdir: Path = DEFAULT_WORKDIR) -> Path:
    """A checkpoint for ``arch``/``preset``, made once and reused across runs."""
    out = Path(workdir) / f"{arch}-{preset}"
    if not (out / "config.json").exists():
        print(f"making {arch}/{preset} in {out} (once) ...", flush=True)
        make_tiny(arch, out, preset, seed=0)
        sync_files(out.glob("*.safetensors"))
    return out


def sync_files(paths) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def drop_page_cache(paths) -> None:
    """Evict ``paths`` from the page cache (posix_fadvise DONTNEED), so the next read hits storage."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_sequential_read(paths, chunk: int = 16 << 20) -> int:
    """Read every byte of ``paths`` front to back into one reused buffer; returns bytes read."""
    buf = bytearray(chunk)
    view = memoryview(buf)
    total = 0
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while n := f.readinto(view):
                total += n
    return total


@contextmanager
def timed(results: dict, key: str):
    t = time.perf_counter()
    yield
    results[key] = time.perf_counter() - t


def print_rows(title: str, header: list[str], rows: list[list]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    print(f"\n{title}")
    for row in [header, *rows]:
        print("  " + "  ".join(str(x).rjust(w) for x, w in zip(row, widths, strict=True)))
