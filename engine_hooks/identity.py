"""Which snapshot a vLLM start may restore: its fingerprint, its place in the parallel layout, the lookup.

The fingerprint is podsnap's (``podsnap.snapshot.fingerprint``): the hash of
every checkpoint tensor's *values* (cached in the store by file identity),
the HF config as vLLM resolved it, dtype, quantization (and KV-cache dtype),
the parallel layout, and the code that shaped the post-processed tensors:
the vLLM version, the platform and device generation, podsnap and torch.

Lookup: the snapshot named after the fingerprint is an exact match. Failing
that, the snapshots vLLM wrote for the same model (same checkpoint source, or
same architecture and config) are compared field by field and the closest
one is reported, so a fine-tune with the same layout reads "weights
(snapshot 1a2b…, requested 3c4d…)".
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from podsnap.snapshot.fingerprint import cached_weights_hash, fingerprint_of
from podsnap.snapshot.manifest import Fingerprint, Manifest
from podsnap.snapshot.store import Store, hash_bytes

from .derived_state import PlatformEntry

ENGINE = "vllm"


@dataclass(frozen=True)
class Placement:
    """This worker's part of the model: ``rank`` of ``world`` (pipeline-major, then tensor-parallel rank),
    and the CPU process group spanning exactly those ranks (None where there is no such group)."""

    rank: int
    world: int
    group: object | None


def placement() -> Placement:
    """Data-parallel replicas share one snapshot (their ranks hold the same tensors)."""
    from vllm.distributed.parallel_state import get_dp_group, get_pp_group, get_tp_group, get_world_group

    tp, pp, dp = get_tp_group(), get_pp_group(), get_dp_group()
    if pp.world_size == 1:
        group = tp.cpu_group
    else:  # vLLM's world group spans the data-parallel replicas too
        group = get_world_group().cpu_group if dp.world_size == 1 else None
    return Placement(pp.rank_in_group * tp.world_size + tp.rank_in_group, tp.world_size * pp.world_size, group)


def checkpoint_dir(model_config, load_config) -> Path:
    """The local directory holding the safetensors checkpoint (downloaded by vLLM's helper if need be)."""
    if os.path.isdir(model_config.model):
        return Path(model_config.model)
    from vllm.model_executor.model_loader.weight_utils import download_weights_from_hf

    return Path(download_weights_from_hf(model_config.model, load_config.download_dir,
                                         ["*.safetensors", "*.json"], model_config.revision,
                                         ignore_patterns=load_config.ignore_patterns))


def layout_tag(entry: PlatformEntry) -> str:
    """The code and device that shaped the post-processed tensors, e.g. ``vllm 0.32.0/cpu``."""
    import vllm
    from vllm.platforms import current_platform

    tag = f"vllm {vllm.__version__}/{current_platform.device_type}"
    if not current_platform.is_cpu() and (cap := current_platform.get_device_capability()) is not None:
        tag += f" cap{cap.to_int()}"
    return tag + (f"/{entry.versions}" if entry.versions else "")


def model_identity(hf_config) -> dict:
    """The HF config as vLLM resolved it, without fields naming where it was read from or which
    transformers wrote it."""
    return {k: v for k, v in hf_config.to_dict().items() if not k.startswith("_") and k != "transformers_version"}


def vllm_fingerprint(vllm_config, model_config, weights: str, entry: PlatformEntry) -> Fingerprint:
    pc = vllm_config.parallel_config
    config = {"hf_config": model_identity(model_config.hf_config), "convert": model_config.convert_type,
              "model_impl": str(model_config.model_impl)}
    return fingerprint_of(
        arch=(model_config.hf_config.architectures or [model_config.architecture])[0],
        config=config,
        weights=weights,
        dtype=str(model_config.dtype).removeprefix("torch."),
        quant=f"{model_config.quantization or 'none'}/kv:{vllm_config.cache_config.cache_dtype}",
        layout=layout_tag(entry),
        parallel=f"tp={pc.tensor_parallel_size},pp={pc.pipeline_parallel_size},dp={pc.data_parallel_size},"
                 f"ep={int(bool(pc.enable_expert_parallel))}",
    )


def requested_fingerprint(vllm_config, model_config, store: Store, entry: PlatformEntry) -> Fingerprint:
    folder = checkpoint_dir(model_config, vllm_config.load_config)
    return vllm_fingerprint(vllm_config, model_config, cached_weights_hash(folder, store), entry)


def snapshot_name(fp: Fingerprint) -> str:
    slug = re.sub(r"[^A-Za-z0-9]+", "-", fp.arch).strip("-")[:48] or "model"
    return f"vllm-{slug}-{hash_bytes(json.dumps(asdict(fp), sort_keys=True).encode())[:16]}"


@dataclass
class Lookup:
    requested: Fingerprint
    name: str  # the snapshot this start restores from, or writes
    match: Manifest | None = None
    closest: Manifest | None = None  # the nearest snapshot of the same model when nothing matches

    def mismatch(self, store: Store) -> str | None:
        """What differs, field by field, or None when there is nothing of this model to compare with."""
        if self.match is not None or self.closest is None:
            return None
        return (f"snapshot {self.closest.snapshot_id!r} in {store.root} does not match this start: "
                f"{self.closest.fingerprint.describe(self.requested)}")


def find_snapshot(store: Store, requested: Fingerprint, source: str) -> Lookup:
    lookup = Lookup(requested, snapshot_name(requested))
    same_model = []
    for manifest in store.manifests():
        fp = manifest.fingerprint
        if manifest.extras.get("engine") != ENGINE:
            continue
        if not fp.differences(requested):
            lookup.match = manifest
            return lookup
        if manifest.extras.get("source") == source or (fp.arch, fp.config) == (requested.arch, requested.config):
            same_model.append(manifest)
    if same_model:
        lookup.closest = min(same_model, key=lambda m: (len(m.fingerprint.differences(requested)), -m.created))
    return lookup
