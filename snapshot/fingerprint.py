"""Model fingerprints: identity from tensor *values*, plus everything restored state depends on.

The weights hash is BLAKE3 over ``name, dtype, shape, BLAKE3(values)`` of
every checkpoint tensor, sorted by name. It does not depend on file names,
sharding or header order, and a fine-tune with the same layout (the vLLM
#59647 case) gets a different hash. Hashing reads the whole checkpoint
once; the result is cached in the store under a key made of each file's
path, size, inode, mtime and ctime, so a rewritten file misses the cache.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

import podsnap
from podsnap.engine.checkpoint import CheckpointReader
from podsnap.engine.config import ModelConfig

from .manifest import Fingerprint
from .store import Store, hash_bytes, write_atomic


def _tensor_hash(reader: CheckpointReader, name: str) -> str:
    t = reader.read(name)
    return hash_bytes(t.reshape(-1).view(torch.uint8).numpy())


def weights_hash(model_dir: str | Path, workers: int = 4) -> str:
    reader = CheckpointReader(model_dir)
    names = sorted(reader.locations)
    with ThreadPoolExecutor(workers) as pool:
        hashes = list(pool.map(lambda n: _tensor_hash(reader, n), names))
    lines = [f"{n}\t{reader.locations[n].dtype}\t{list(reader.locations[n].shape)}\t{h}"
             for n, h in zip(names, hashes, strict=True)]
    return hash_bytes("\n".join(lines).encode())


def _cache_key(model_dir: Path) -> str:
    reader = CheckpointReader(model_dir)
    files = sorted({loc.path.resolve() for loc in reader.locations.values()})
    stats = [(str(p), st.st_size, st.st_ino, st.st_dev, st.st_mtime_ns, st.st_ctime_ns)
             for p in files for st in [p.stat()]]
    return hash_bytes(json.dumps(stats).encode())


def cached_weights_hash(model_dir: str | Path, store: Store | None = None) -> str:
    """``weights_hash``, remembered in the store's fingerprint cache for unchanged files."""
    model_dir = Path(model_dir)
    if store is None:
        return weights_hash(model_dir)
    entry = store.fpcache_dir / f"{_cache_key(model_dir)}.json"
    if entry.exists():
        try:
            return json.loads(entry.read_text())["weights"]
        except (json.JSONDecodeError, KeyError):
            entry.unlink()
    digest = weights_hash(model_dir)
    write_atomic(entry, json.dumps({"weights": digest, "model_dir": str(model_dir.resolve())}).encode())
    return digest


def plan_digest(plan: dict) -> str:
    """World size and hash of the layouts. Intervals are left out: they follow from the layouts,
    the model config and the code version, which the fingerprint covers already."""
    layouts = {k: plan[k] for k in ("world_size", "layouts", "expert_placement")}
    return f"tp={plan['world_size']}/" + hash_bytes(json.dumps(layouts, sort_keys=True).encode())[:16]


def fingerprint_of(arch: str, config: dict, weights: str, dtype: str, quant: str, layout: str,
                   parallel: str) -> Fingerprint:
    """The one place a fingerprint is assembled (any engine): the config is hashed, code versions added."""
    return Fingerprint(
        arch=arch,
        config=hash_bytes(json.dumps(config, sort_keys=True, default=str).encode()),
        weights=weights,
        dtype=dtype,
        quant=quant,
        layout=layout,
        parallel=parallel,
        podsnap_version=podsnap.__version__,
        torch_version=torch.__version__,
    )


def make_fingerprint(cfg: ModelConfig, weights: str, options: dict, plan: dict, layout: str) -> Fingerprint:
    return fingerprint_of(cfg.arch, cfg.to_dict(), weights, options["dtype"], options["quant"], layout,
                          plan_digest(plan))
