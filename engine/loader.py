"""Filling a model's checkpoint tensors from an HF checkpoint, shard by shard.

Every module that holds a checkpoint tensor names it (``module.logical``)
and, for a Linear, the interval of it this rank holds (``module.shard``).
Row shards are read as one byte range; column shards read the rows whole
and keep the columns (safetensors stores rows contiguously).
"""

from __future__ import annotations

import torch
from torch import nn

from .checkpoint import CheckpointReader
from .layers import Linear


def checkpoint_modules(model: nn.Module) -> list[nn.Module]:
    """Modules that hold a tensor read from the checkpoint, in model order."""
    return [m for m in model.modules() if hasattr(m, "logical") and getattr(m, "weight", None) is not None]


def full_shape(module: nn.Module) -> tuple[int, ...]:
    """Shape of the unsharded checkpoint tensor behind ``module.weight``."""
    shape = list(module.weight.shape)
    shard = getattr(module, "shard", None)
    if shard is not None:
        shape[shard.dim] = shard.size
    return tuple(shape)


def read_module_weight(reader: CheckpointReader, module: nn.Module) -> torch.Tensor:
    shard = module.shard if isinstance(module, Linear) else None
    shape = full_shape(module)
    if shard is None or shard.is_full:
        return reader.read(module.logical, shape)
    if shard.dim == 0:
        return reader.read(module.logical, shape, rows=(shard.start, shard.stop))
    return reader.read(module.logical, shape).narrow(shard.dim, shard.start, shard.stop - shard.start)


def load_checkpoint(model: nn.Module, reader: CheckpointReader, dtype: torch.dtype) -> int:
    """Read every checkpoint tensor of ``model``; returns the bytes read."""
    before = reader.bytes_read
    for module in checkpoint_modules(model):
        tensor = read_module_weight(reader, module).to(dtype).contiguous()
        module.weight = nn.Parameter(tensor, requires_grad=False)
    return reader.bytes_read - before
