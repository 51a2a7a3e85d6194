"""Derived state a vLLM model keeps outside ``state_dict``, per platform: what capture and restore also cover.

Parameters and buffers (persistent or not, e.g. the RoPE ``cos_sin_cache``)
are walked generically by ``model_state.py``. What that walk cannot see is
listed here, per vLLM platform:

- plain module attributes: tensors, lists of tensors and Python floats
  (attention ``_k_scale_cpu`` / ``_k_scale_float``; vllm-ascend's W8A8
  ``aclnn_input_scale``), matched by class name on the module or its
  quantization method;
- module-level globals (vllm-ascend's RoPE ``_cos_sin_cache``);
- *derivations*: post-processing steps whose product is not a tensor at all,
  such as the oneDNN GEMM handle vLLM's CPU backend builds behind
  ``layer.cpu_linear`` (a C++ object that owns the packed weight). The
  snapshot keeps the step's input (the weight as loaded) and the restore
  reruns the step on it;
- device layouts a restored tensor must be put back into (Ascend NZ);
- hooks run after a restore (re-record globals) and after a group rebuild
  (re-point handles that modules keep, e.g. vllm-ascend's MoE groups).

An entry also names the quantization methods whose post-processing it
covers completely. A model with any other method (or with a model-level
``process_weights_after_loading``, or an attention backend that post-processes)
is neither snapshotted nor restored: ``uncovered`` names those layers, and the
loader loads it the usual way.

Names in the snapshot: ``module.attr`` for an attribute, ``module.attr#i``
for item ``i`` of a list, ``python.module:NAME`` for a global; Python floats
are stored as 0-d float64 tensors with the layout tag ``py-float``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from podsnap.errors import PodsnapError
from podsnap.state import Role, StateTensor, TensorMeta

PY_FLOAT = "py-float"
RUNTIME_ATTRS = frozenset({"kv_cache"})  # engine-owned, (re)allocated after loading: not model state


@dataclass(frozen=True)
class AttrSpec:
    """Attributes kept by modules whose class, or whose quant method's class, is one of ``owners``."""

    owners: tuple[str, ...]
    attrs: tuple[str, ...]


@dataclass(frozen=True)
class GlobalSpec:
    """Module-level globals (a tensor or a list of tensors each) of the Python module ``module``."""

    module: str
    names: tuple[str, ...]


@dataclass(frozen=True)
class Derivation:
    """A post-processing step whose product is not a tensor: keep ``inputs(module)``, rerun ``run``.

    ``inputs`` names the module attributes whose value *before* post-processing
    the snapshot stores (empty: the step does not apply to this module);
    ``drop`` releases the product (suspend), ``run`` rebuilds it (restore, resume).
    """

    name: str
    inputs: Callable[[nn.Module], tuple[str, ...]]
    run: Callable[[nn.Module], None]
    drop: Callable[[nn.Module], None]


@dataclass(frozen=True)
class PlatformEntry:
    platform: str  # vLLM's current_platform.device_type: "cpu", "cuda", "npu", ...
    covered: frozenset[str]  # quant methods and attention backends whose post-processing is covered
    attrs: tuple[AttrSpec, ...] = ()
    globals: tuple[GlobalSpec, ...] = ()
    derivations: tuple[Derivation, ...] = ()
    layout_of: Callable[[torch.Tensor], str] = lambda t: "nd"  # device layout tag of a live tensor
    to_layout: dict[str, Callable[[torch.Tensor], torch.Tensor]] = field(default_factory=dict)  # tag -> cast
    after_restore: tuple[Callable[[nn.Module], None], ...] = ()  # (model)
    before_teardown: tuple[Callable[[], None], ...] = ()  # destroy groups vLLM's own teardown does not know
    after_rebuild: tuple[Callable[[nn.Module, object], None], ...] = ()  # (model, vllm_config)
    versions: str = ""  # versions of platform code that shape the tensors (e.g. vllm-ascend), for the fingerprint
    verified: bool = True  # False: written from the engine's source, not run against it here


# --- the CPU and CUDA entries (what vLLM itself keeps) ----------------------------------------------

ATTENTION_SCALES = AttrSpec(("Attention",), ("_k_scale_cpu", "_v_scale_cpu", "_q_scale_float", "_k_scale_float",
                                             "_v_scale_float", "_prob_scale_float"))
UNQUANTIZED = frozenset({"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"})


def _cpu_gemm_inputs(module: nn.Module) -> tuple[str, ...]:
    name = type(getattr(module, "quant_method", None)).__name__
    return ("weight",) if name in UNQUANTIZED and getattr(module, "weight", None) is not None else ()


def _cpu_gemm_run(module: nn.Module) -> None:
    """What vLLM's unquantized linear/embedding methods do on CPU after loading: build the GEMM handle."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    if getattr(module, "_cpu_skip_gemm_dispatch", False):
        module.cpu_linear = torch.nn.functional.linear
        return
    linear = type(module.quant_method).__name__ == "UnquantizedLinearMethod"
    dispatch_cpu_unquantized_gemm(module, remove_weight=linear)


def _cpu_gemm_drop(module: nn.Module) -> None:
    module.cpu_linear = _suspended


def _suspended(*args, **kwargs):
    raise PodsnapError("this vLLM worker is suspended by podsnap (its weights are in the store); call "
                       "collective_rpc('podsnap_resume') first")


CPU_GEMM = Derivation("cpu-gemm", _cpu_gemm_inputs, _cpu_gemm_run, _cpu_gemm_drop)

REGISTRY: dict[str, PlatformEntry] = {
    "cpu": PlatformEntry("cpu", UNQUANTIZED, attrs=(ATTENTION_SCALES,), derivations=(CPU_GEMM,)),
    # CUDA: the unquantized methods post-process nothing there; unverified on these machines (no GPU).
    "cuda": PlatformEntry("cuda", UNQUANTIZED, attrs=(ATTENTION_SCALES,), verified=False),
}


def entry_for(platform: str) -> PlatformEntry:
    """The entry of a vLLM platform (``current_platform.device_type``); the Ascend one is imported on demand."""
    if platform == "npu" and platform not in REGISTRY:
        from .ascend import ascend_entry

        REGISTRY["npu"] = ascend_entry()
    if platform not in REGISTRY:
        raise PodsnapError(f"podsnap has no derived-state entry for vLLM platform {platform!r} "
                           f"(known: {', '.join(sorted(REGISTRY))}); its snapshots would miss state")
    return REGISTRY[platform]


# --- walking a model with an entry -----------------------------------------------------------------

def _class_names(obj) -> set[str]:
    return {c.__name__ for c in type(obj).__mro__}


def owns(module: nn.Module, spec: AttrSpec) -> bool:
    names = _class_names(module)
    qm = getattr(module, "quant_method", None)
    if qm is not None:
        names |= _class_names(qm) | _class_names(getattr(qm, "quant_method", None))
    return bool(names & set(spec.owners))


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def attr_names(entry: PlatformEntry, module: nn.Module) -> list[str]:
    """The registered attributes ``module`` has as plain attributes (registered parameters and buffers
    are captured as such: vllm-ascend assigns some scales as Parameters, some as tensors)."""
    return [a for spec in entry.attrs if owns(module, spec) for a in spec.attrs
            if a in vars(module) and a not in module._parameters and a not in module._buffers]


def _flatten(name: str, value) -> Iterator[tuple[str, torch.Tensor, str]]:
    """(name, tensor, layout) for a tensor, a list/tuple of tensors or a Python float."""
    if isinstance(value, torch.Tensor):
        yield name, value, "nd"
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            if isinstance(item, torch.Tensor):
                yield f"{name}#{i}", item, "nd"
    elif isinstance(value, float):
        yield name, torch.tensor(value, dtype=torch.float64), PY_FLOAT


def derived_tensors(model: nn.Module, entry: PlatformEntry) -> list[StateTensor]:
    """Every registered attribute and global of ``model``, as engine-state tensors of role ``derived``."""
    out: list[StateTensor] = []
    for prefix, module in model.named_modules():
        for attr in attr_names(entry, module):
            for name, t, layout in _flatten(_join(prefix, attr), getattr(module, attr)):
                layout = entry.layout_of(t) if layout == "nd" else layout
                out.append(StateTensor(name, TensorMeta(Role.DERIVED, layout), t))
    for spec in entry.globals:
        mod = importlib.import_module(spec.module)
        for g in spec.names:
            for name, t, layout in _flatten(f"{spec.module}:{g}", getattr(mod, g, None)):
                out.append(StateTensor(name, TensorMeta(Role.DERIVED, layout), t))
    return out


def restore_derived(model: nn.Module, entry: PlatformEntry, name: str, value: torch.Tensor, layout: str) -> None:
    """Put one ``derived`` tensor of a snapshot back where ``derived_tensors`` found it. A global must be
    one the entry registers: a manifest never makes the restore import a module of its choosing."""
    item = value.item() if layout == PY_FLOAT else value
    path, _, index = name.partition("#")
    if ":" in path:
        pymod, _, attr = path.partition(":")
        if not any(spec.module == pymod and attr in spec.names for spec in entry.globals):
            raise PodsnapError(f"snapshot tensor {name!r} names a global that the {entry.platform!r} entry of the "
                               "derived-state registry does not register")
        owner = importlib.import_module(pymod)
    else:
        prefix, _, attr = path.rpartition(".")
        try:
            owner = model.get_submodule(prefix) if prefix else model
        except AttributeError:
            raise PodsnapError(f"snapshot tensor {name!r} has no place in this model") from None
    if not index:
        setattr(owner, attr, item)
        return
    current = list(getattr(owner, attr, None) or [])
    current.extend([None] * (int(index) + 1 - len(current)))
    current[int(index)] = item
    setattr(owner, attr, current)


def derivation_inputs(model: nn.Module, entry: PlatformEntry) -> dict[str, torch.Tensor]:
    """Right after ``load_weights``: the tensors the derivations will consume, by state name."""
    out = {}
    for prefix, module in model.named_modules():
        for d in entry.derivations:
            for attr in d.inputs(module):
                out[_join(prefix, attr)] = getattr(module, attr).data
    return out


def rederive(model: nn.Module, entry: PlatformEntry) -> dict[str, int]:
    """Rerun every derivation on a restored model; returns how many modules each one ran on."""
    counts = {d.name: 0 for d in entry.derivations}
    for _, module in model.named_modules():
        for d in entry.derivations:
            if d.inputs(module):
                d.run(module)
                counts[d.name] += 1
    for hook in entry.after_restore:
        hook(model)
    return counts


def uncovered(model: nn.Module, entry: PlatformEntry) -> list[str]:
    """Layers whose post-processed state this entry does not cover, with the reason (empty: all covered)."""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.v1.attention.backend import AttentionImplBase

    base = AttentionImplBase.process_weights_after_loading
    out = []
    if callable(getattr(model, "process_weights_after_loading", None)):
        out.append(f"<model>: {type(model).__name__}.process_weights_after_loading")
    for prefix, module in model.named_modules():
        qm = getattr(module, "quant_method", None)
        if isinstance(qm, QuantizeMethodBase) and type(qm).__name__ not in entry.covered:
            out.append(f"{prefix}: quant method {type(qm).__name__}")
        impl = getattr(module, "impl", None)
        pwal = getattr(type(impl), "process_weights_after_loading", base)
        if impl is not None and pwal is not base and type(impl).__name__ not in entry.covered:
            out.append(f"{prefix}: attention backend {type(impl).__name__} post-processes its weights")
    return out


def unregistered_tensor_attrs(model: nn.Module, entry: PlatformEntry) -> list[str]:
    """Tensor attributes (or lists of them) that are neither parameters, buffers nor in the registry."""
    out = []
    for prefix, module in model.named_modules():
        known = set(attr_names(entry, module)) | RUNTIME_ATTRS
        for attr, value in vars(module).items():
            is_tensor = isinstance(value, torch.Tensor) or (
                isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value))
            if is_tensor and attr not in known:
                out.append(_join(prefix, attr))
    return out
