"""Reading HF safetensors checkpoints by byte ranges.

A safetensors file is an 8-byte little-endian header length, a JSON header
(name -> dtype, shape, data_offsets) and the raw tensor bytes. We parse only
the headers, then read each tensor — or just the rows one rank needs — with
``os.pread`` at its offset. Nothing parses a whole file into a dict of tensors.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from podsnap.errors import CheckpointError

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorLocation:
    name: str
    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the tensor data in the file
    nbytes: int

    @property
    def row_bytes(self) -> int:
        return self.nbytes // self.shape[0] if self.shape and self.shape[0] else self.nbytes


def read_header(path: Path) -> tuple[dict, int]:
    """Return (header dict, byte offset where tensor data starts)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise CheckpointError(f"{path} is not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER_BYTES:
                raise CheckpointError(f"{path} is not a safetensors file (header length {n})")
            header = json.loads(f.read(n))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read safetensors header of {path}: {e}") from None
    header.pop("__metadata__", None)
    return header, 8 + n


class CheckpointReader:
    """Index of every tensor in an HF checkpoint directory, read lazily by byte range."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self.locations: dict[str, TensorLocation] = {}
        for path in self._files():
            self._index_file(path)
        self.bytes_read = 0

    def _files(self) -> list[Path]:
        index = self.model_dir / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from None
            files = sorted({self.model_dir / f for f in weight_map.values()})
        else:
            files = sorted(self.model_dir.glob("*.safetensors"))
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"checkpoint shard(s) missing: {', '.join(missing)}")
        if not files:
            raise CheckpointError(f"no *.safetensors file in {self.model_dir}")
        return files

    def _index_file(self, path: Path) -> None:
        header, data_start = read_header(path)
        size = path.stat().st_size
        for name, entry in header.items():
            dtype = DTYPES.get(entry.get("dtype"))
            if dtype is None:
                raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {entry.get('dtype')!r}")
            start, stop = entry["data_offsets"]
            shape = tuple(entry["shape"])
            expected = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            if stop - start != expected or data_start + stop > size:
                raise CheckpointError(f"{path}: tensor {name!r} byte range {start}..{stop} does not "
                                      f"match shape {list(shape)} or the file size {size}")
            self.locations[name] = TensorLocation(name, path, dtype, shape, data_start + start, stop - start)

    def location(self, name: str) -> TensorLocation:
        loc = self.locations.get(name)
        if loc is None:
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint in {self.model_dir}")
        return loc

    def read(self, name: str, shape: tuple[int, ...] | None = None,
             rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Read tensor ``name`` (only rows ``[start, stop)`` of dim 0 if given).

        ``shape`` is the shape the model expects; a different shape in the file
        is an error naming both.
        """
        loc = self.location(name)
        if shape is not None and tuple(shape) != loc.shape:
            raise CheckpointError(f"tensor {name!r} in {loc.path.name} has shape {list(loc.shape)}, "
                                  f"the model expects {list(shape)}")
        start, stop = rows if rows is not None else (0, loc.shape[0] if loc.shape else 1)
        out_shape = (stop - start, *loc.shape[1:]) if loc.shape else ()
        nbytes = loc.row_bytes * (stop - start)
        buf = torch.empty(nbytes, dtype=torch.uint8)  # not zero-filled, unlike bytearray
        fd = os.open(loc.path, os.O_RDONLY)
        try:
            n = os.preadv(fd, [buf.numpy()], loc.offset + start * loc.row_bytes) if nbytes else 0
        finally:
            os.close(fd)
        if n != nbytes:
            raise CheckpointError(f"{loc.path}: short read of tensor {name!r} ({n} of {nbytes} bytes)")
        self.bytes_read += n
        return buf.view(loc.dtype).reshape(out_shape)


def write_checkpoint(model_dir: Path, tensors: dict[str, torch.Tensor], shards: int = 1) -> list[Path]:
    """Write ``tensors`` as HF safetensors (``shards`` files plus an index when > 1)."""
    from safetensors.torch import save_file

    names = list(tensors)
    if shards < 1 or shards > len(names):
        raise CheckpointError(f"--shards {shards} must be in 1..{len(names)} (the tensor count)")
    if shards == 1:
        path = model_dir / "model.safetensors"
        save_file({n: tensors[n].contiguous() for n in names}, str(path), metadata={"format": "pt"})
        return [path]
    paths, weight_map = [], {}
    for i in range(shards):
        part = names[i * len(names) // shards:(i + 1) * len(names) // shards]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in part}, str(model_dir / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
        paths.append(model_dir / fname)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return paths
