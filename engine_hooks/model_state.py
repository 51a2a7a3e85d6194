"""A vLLM model as podsnap engine state (``podsnap.state``), and a meta-built model filled back from it.

Capture: every parameter and buffer (persistent or not, e.g. RoPE
``cos_sin_cache``) by module path, the platform's derived state
(``derived_state.py``), and, where a derivation consumed a tensor (the CPU
GEMM handle eats the linear weights), the tensor as it was before. A tensor
reachable under several names (tied embeddings, the RoPE module every layer
shares) is stored once; the other names become aliases.

Restore: the model is built on the meta device; each snapshot tensor
replaces its placeholder (moved to the target device and put back into its
device layout), aliases point at the same object, the derivations rerun, and
no meta tensor may be left anywhere (parameters, buffers, tensor attributes):
otherwise the restore is refused with their names.

vLLM shards are recorded whole (no interval of the unsharded tensor): vLLM
fuses q/k/v and gate/up, so one shard does not map to one checkpoint slice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from podsnap.errors import PodsnapError
from podsnap.snapshot.manifest import TensorRecord
from podsnap.state import EngineState, Role, StateTensor, TensorMeta

from . import derived_state
from .derived_state import PlatformEntry


class IncompleteRestore(PodsnapError):
    """The snapshot did not fill every tensor the model needs."""


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _host(t: torch.Tensor) -> torch.Tensor:
    return t.detach() if t.device.type == "cpu" else t.detach().cpu()


def capture_state(model: nn.Module, entry: PlatformEntry, rank: int, world: int,
                  inputs: dict[str, torch.Tensor]) -> tuple[EngineState, dict[str, str]]:
    """(engine state of this rank, aliases {name: canonical name}); ``inputs`` from ``derivation_inputs``."""
    state = EngineState(rank, world)
    seen: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for table, role in ((module._parameters, Role.PARAMETER), (module._buffers, Role.BUFFER)):
            for leaf, t in table.items():
                if t is None:
                    continue
                name = _join(prefix, leaf)
                if id(t) in seen:
                    aliases[name] = seen[id(t)]
                    continue
                seen[id(t)] = name
                live = inputs.get(name, t)
                state.tensors.append(StateTensor(name, TensorMeta(role, entry.layout_of(live)), _host(live)))
    for st in derived_state.derived_tensors(model, entry):
        state.tensors.append(StateTensor(st.name, st.meta, _host(st.tensor)))
    return state, aliases


def _place(module: nn.Module, leaf: str, t: torch.Tensor, name: str) -> None:
    if leaf in module._parameters:
        old = module._parameters[leaf]
        new = nn.Parameter(t, requires_grad=False)
        if old is not None:
            new.__dict__.update(old.__dict__)  # vLLM's weight attributes (weight_loader, output_dim, ...)
        module._parameters[leaf] = new
    elif leaf in module._buffers:
        module._buffers[leaf] = t
    else:
        raise PodsnapError(f"snapshot tensor {name!r} has no place in this model (a different vLLM model class?)")


def fill_model(model: nn.Module, tensors: dict[str, torch.Tensor], records: list[TensorRecord],
               aliases: dict[str, str], entry: PlatformEntry, device: torch.device) -> dict[str, int]:
    """Put every restored tensor into the meta-built ``model``; returns the derivation counts."""
    placed: dict[str, torch.Tensor] = {}
    for record in records:
        t = tensors[record.name]
        if device.type != "cpu":
            t = t.to(device)
        if record.layout in entry.to_layout:
            t = entry.to_layout[record.layout](t)
        if record.role == Role.DERIVED:
            derived_state.restore_derived(model, entry, record.name, t, record.layout)
            continue
        prefix, _, leaf = record.name.rpartition(".")
        try:
            module = model.get_submodule(prefix) if prefix else model
        except AttributeError:
            raise PodsnapError(f"snapshot tensor {record.name!r} has no place in this model") from None
        _place(module, leaf, t, record.name)
        placed[record.name] = module._parameters.get(leaf, module._buffers.get(leaf))
    for alias, canonical in aliases.items():
        if canonical not in placed:
            raise PodsnapError(f"snapshot alias {alias!r} names {canonical!r}, which the snapshot lacks")
        prefix, _, leaf = alias.rpartition(".")
        module = model.get_submodule(prefix) if prefix else model
        table = module._parameters if leaf in module._parameters else module._buffers
        table[leaf] = placed[canonical]
    counts = derived_state.rederive(model, entry)
    missing = meta_leftovers(model)
    if missing:
        raise IncompleteRestore(f"the snapshot left {len(missing)} tensor(s) of this model unfilled, e.g. "
                                f"{missing[:4]}; the derived-state registry for platform {entry.platform!r} "
                                "does not cover them")
    return counts


def meta_leftovers(model: nn.Module) -> list[str]:
    """Names of meta tensors anywhere in ``model``: parameters, buffers and tensor attributes (lists too)."""
    out = []
    for prefix, module in model.named_modules():
        for leaf, t in [*module._parameters.items(), *module._buffers.items()]:
            if t is not None and t.is_meta:
                out.append(_join(prefix, leaf))
        for attr, value in vars(module).items():
            items = value if isinstance(value, (list, tuple)) else [value]
            if attr not in derived_state.RUNTIME_ATTRS and any(isinstance(v, torch.Tensor) and v.is_meta
                                                               for v in items):
                out.append(_join(prefix, attr))
    return out


@dataclass(frozen=True)
class Released:
    bytes_freed: int  # tensors turned into meta tensors
    products_dropped: int  # derivation products (kernel handles, which hold packed weights) let go


def release(model: nn.Module, entry: PlatformEntry) -> Released:
    """Suspend: parameters, buffers and registered tensor attributes become meta tensors of the same
    shape and dtype (``fill_model`` fills them back); derivation products are dropped."""
    freed, dropped, seen = 0, 0, set()

    def meta_of(t: torch.Tensor) -> torch.Tensor:
        nonlocal freed
        if id(t) not in seen:
            seen.add(id(t))
            freed += t.nbytes
        meta = torch.empty_like(t, device="meta")
        if not isinstance(t, nn.Parameter):
            return meta
        p = nn.Parameter(meta, requires_grad=False)
        p.__dict__.update(t.__dict__)
        return p

    for _, module in model.named_modules():
        for d in entry.derivations:
            if d.inputs(module):
                d.drop(module)
                dropped += 1
        for table in (module._parameters, module._buffers):
            for leaf, t in table.items():
                if t is not None and not t.is_meta:
                    table[leaf] = meta_of(t)
        for attr in derived_state.attr_names(entry, module):
            value = getattr(module, attr)
            if isinstance(value, torch.Tensor):
                setattr(module, attr, meta_of(value))
            elif isinstance(value, (list, tuple)):
                setattr(module, attr, [meta_of(v) if isinstance(v, torch.Tensor) else v for v in value])
    return Released(freed, dropped)
