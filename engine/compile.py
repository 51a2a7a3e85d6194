"""Optional ``torch.compile`` of the dense FFN blocks, with a cache that can travel.

Inductor's FX-graph and AOT-autograd caches live under
``TORCHINDUCTOR_CACHE_DIR``; a snapshot stores that directory (``pack_cache``)
and a restore unpacks it into a fresh private directory (``unpack_cache``)
before the first forward, so the restored start hits the cache and compiles
nothing. Precompiled headers are turned off: they live outside the cache
directory (under the temp dir), so with them on a new machine would rebuild
one (seconds of g++) despite the hits. Settings are part of the cache key and
are the same on both sides because they are set here.

Compiled: each dense layer's ``post-attention norm + MLP`` (``dynamic=True``;
one graph for 1-token decode steps, one for longer prefills). Attention (a
per-sequence Python loop over the paged cache), MoE routing and W8A8 strips
are left eager.
"""

from __future__ import annotations

import io
import os
import tarfile
import tempfile
from pathlib import Path

import torch

CACHE_COUNTERS = ("fxgraph_cache_hit", "fxgraph_cache_miss")


def configure_cache(cache_dir: str | Path) -> Path:
    """Point inductor at ``cache_dir`` with persistent, relocatable caches."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    cache_dir = Path(cache_dir)
    cache_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)
    inductor_config.fx_graph_cache = True
    inductor_config.cpp_cache_precompile_headers = False
    functorch_config.enable_autograd_cache = True
    return cache_dir


def private_cache_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="podsnap-inductor-"))


def compile_model(model) -> int:
    """Compile the FFN block of every dense layer; returns how many were wrapped."""
    from .model import MLP

    n = 0
    for layer in model.model.layers:
        if isinstance(layer.mlp, MLP) and not layer.mlp.gate_proj.is_quantized:
            layer.ffn = torch.compile(layer.ffn, dynamic=True)
            n += 1
    return n


def cache_counters() -> dict[str, int]:
    """Inductor FX-graph cache hits and misses in this process so far."""
    from torch._dynamo.utils import counters

    return {k: int(counters["inductor"].get(k, 0)) for k in CACHE_COUNTERS}


def pack_cache(cache_dir: str | Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        tar.add(str(cache_dir), arcname=".")
    return buf.getvalue()


def unpack_cache(data: bytes, dest: str | Path) -> Path:
    """Extract a packed cache; members that would land outside ``dest`` are refused."""
    dest = Path(dest)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        tar.extractall(dest, filter="data")
    return dest
