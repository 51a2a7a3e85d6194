"""The snapshot manifest: typed records of everything a snapshot holds.

A manifest lists, per rank, every tensor of the engine state contract with
the blob that holds its bytes, its hash, role, dtype, shape, layout tag and
the interval of the unsharded tensor it covers, plus the sharding plan and
the model fingerprint. It is JSON with a schema version; parsing checks
every field and says which one is wrong.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields

from podsnap.errors import PodsnapError

SCHEMA_VERSION = 1


class ManifestError(PodsnapError):
    """A manifest is missing, truncated or does not follow the schema."""


@dataclass(frozen=True)
class Fingerprint:
    """Model identity plus everything that makes restored state valid for this engine."""

    arch: str
    config: str  # hash of the model config
    weights: str  # hash of the hashes of every checkpoint tensor's *values*
    dtype: str
    quant: str
    layout: str  # platform and device layout of derived tensors, e.g. "cpu/nz"
    parallel: str  # world size and hash of the sharding plan
    podsnap_version: str
    torch_version: str

    def differences(self, other: Fingerprint) -> list[str]:
        return [f.name for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]

    def describe(self, other: Fingerprint) -> str:
        """'weights (snapshot 1a2b.., requested 3c4d..), quant (...)' for every differing field."""
        return ", ".join(f"{name} (snapshot {_short(getattr(self, name))}, requested {_short(getattr(other, name))})"
                         for name in self.differences(other))


def _short(v: str) -> str:
    return v[:16] + "…" if len(v) > 20 else v


@dataclass(frozen=True)
class TensorRecord:
    name: str
    role: str
    dtype: str
    shape: list[int]
    layout: str
    interval: dict | None
    blob: str  # content hash = blob file name
    offset: int
    length: int
    derive: str | None = None  # stored in ND form; convert to this layout on first use


@dataclass(frozen=True)
class RankRecord:
    rank: int
    tensors: list[TensorRecord]
    compile_cache: dict | None = None  # {"blob", "length"}: this rank's packed inductor cache

    @property
    def nbytes(self) -> int:
        return sum(t.length for t in self.tensors)


@dataclass
class Manifest:
    snapshot_id: str
    created: float
    model_config: dict  # ModelConfig.to_dict()
    options: dict  # EngineOptions as a dict
    fingerprint: Fingerprint
    plan: dict  # ShardPlan.to_dict()
    ranks: list[RankRecord]
    with_kv: bool = False
    extras: dict = field(default_factory=dict)  # e.g. compile cache blob, KV block tables
    schema: int = SCHEMA_VERSION

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.ranks)

    def blobs(self) -> set[str]:
        out = {t.blob for r in self.ranks for t in r.tensors}
        return out | {r.compile_cache["blob"] for r in self.ranks if r.compile_cache}

    def unique_bytes(self) -> int:
        sizes = {t.blob: t.length for r in self.ranks for t in r.tensors}
        return sum(sizes.values())

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, source: str = "manifest") -> Manifest:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ManifestError(f"{source} is not valid JSON (truncated or corrupt?): {e}") from None
        if not isinstance(d, dict):
            raise ManifestError(f"{source} is not a JSON object")
        if d.get("schema") != SCHEMA_VERSION:
            raise ManifestError(f"{source} has schema {d.get('schema')!r}; this podsnap reads schema "
                                f"{SCHEMA_VERSION}")
        try:
            return cls(
                snapshot_id=d["snapshot_id"], created=float(d["created"]), model_config=dict(d["model_config"]),
                options=dict(d["options"]), fingerprint=Fingerprint(**d["fingerprint"]), plan=dict(d["plan"]),
                ranks=[RankRecord(int(r["rank"]), [TensorRecord(**t) for t in r["tensors"]], r.get("compile_cache"))
                       for r in d["ranks"]],
                with_kv=bool(d.get("with_kv", False)), extras=dict(d.get("extras", {})), schema=d["schema"])
        except (KeyError, TypeError, ValueError) as e:
            raise ManifestError(f"{source} does not follow the manifest schema: {type(e).__name__}: {e}") from None
