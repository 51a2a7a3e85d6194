"""The engine state contract: what one rank of an engine holds, tensor by tensor.

This is the only view the snapshot and restore sides have of an engine
(ARCHITECTURE.md, "Contracts"). The reference engine produces it natively,
the vLLM hooks produce it for vLLM. Each entry says what the tensor is
(role), how it is laid out on the device (layout tag) and which part of the
unsharded logical tensor it covers (interval), so a restore can be planned
per interval without looking inside the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

import torch


class Role(StrEnum):
    PARAMETER = "parameter"  # a tensor read from the checkpoint, used as is
    BUFFER = "buffer"  # engine-owned state that is not a checkpoint tensor
    DERIVED = "derived"  # produced by post-processing (quantized, re-laid-out, tables)
    KV = "kv"  # KV-cache blocks


@dataclass(frozen=True)
class Interval:
    """The slice ``[start, stop)`` along ``dim`` of a logical tensor of ``size`` along ``dim``."""

    logical: str  # name of the unsharded tensor (an HF checkpoint name where there is one)
    dim: int
    start: int
    stop: int
    size: int

    @property
    def is_full(self) -> bool:
        return self.start == 0 and self.stop == self.size

    def to_dict(self) -> dict:
        return {"logical": self.logical, "dim": self.dim, "start": self.start,
                "stop": self.stop, "size": self.size}

    @classmethod
    def from_dict(cls, d: dict) -> Interval:
        return cls(d["logical"], int(d["dim"]), int(d["start"]), int(d["stop"]), int(d["size"]))


@dataclass(frozen=True)
class TensorMeta:
    """What the engine knows about one of its tensors besides its values."""

    role: Role
    layout: str = "nd"  # "nd" (row-major), "nz" (Ascend FRACTAL_NZ), ...
    interval: Interval | None = None  # None: the tensor is whole, not a shard of anything
    nd_shape: tuple[int, ...] | None = None  # for a re-laid-out tensor: its shape in plain ND form


@dataclass
class StateTensor:
    """One named tensor of a rank's engine state."""

    name: str
    meta: TensorMeta
    tensor: torch.Tensor

    @property
    def dtype(self) -> str:
        return str(self.tensor.dtype).removeprefix("torch.")

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


@dataclass
class EngineState:
    """Every tensor one rank needs to serve, in a stable order."""

    rank: int
    world_size: int
    tensors: list[StateTensor] = field(default_factory=list)

    def by_name(self) -> dict[str, StateTensor]:
        return {t.name: t for t in self.tensors}

    def of_role(self, role: Role) -> list[StateTensor]:
        return [t for t in self.tensors if t.meta.role is role]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)
