"""The vllm-ascend entry of the derived-state registry. Import-guarded; NOT verified on these machines.

There is no NPU, torch_npu or vllm-ascend here: everything below was written
from reading vllm-ascend's source and is exercised only against a mock in
``tests/test_vllm_hooks.py`` (which checks podsnap's calls, not Ascend's
behaviour). What it covers, beyond ``state_dict``:

- NZ weights. vllm-ascend's post-processing casts linear (and MoE) weights to
  FRACTAL_NZ with ``torch_npu.npu_format_cast(w, 29)``. Capture tags such a
  tensor ``npu-nz`` and stores what a copy to the host gives (assumed: its
  values in ND order); restore moves it to the NPU and casts it again with the
  same call. Sleep mode's ``wake_up`` restores bytes, not formats, so it
  cannot rebuild these; the snapshot can. Unverified: that the host copy of
  an NZ tensor is ND.
- W8A8 scales kept as plain attributes (``aclnn_input_scale``,
  ``aclnn_input_scale_reciprocal``, ``aclnn_input_offset``, ``deq_scale``,
  ``quant_bias`` where they are not registered).
- RoPE caches kept as globals of ``vllm_ascend.ops.rotary_embedding``
  (``_cos_sin_cache``, ``_cos_cache``, ``_sin_cache``): recorded once, from the
  first rotary module built. A restore gives that module a new buffer, so the
  globals are cleared and recorded again from it (``rerecord_rope``).
- MoE layers keep ``moe_config.tp_group / dp_group / ep_group / mc2_group``.
  A group rebuild destroys the Ascend groups (MC2, ...) before vLLM's, creates
  them again after (``init_ascend_model_parallel``) and re-points every MoE
  layer's handles at the new groups.

Which vllm-ascend quantization methods and attention backends are covered is
a list of class names from its source (``COVERED``); a model using others is
neither snapshotted nor restored.
"""

from __future__ import annotations

import importlib
import importlib.util

import torch
from torch import nn

from podsnap.errors import PodsnapError

from .derived_state import ATTENTION_SCALES, UNQUANTIZED, AttrSpec, PlatformEntry

ACL_FORMAT_FRACTAL_NZ = 29
NZ = "npu-nz"
ROPE_MODULE = "vllm_ascend.ops.rotary_embedding"
ROPE_GLOBALS = ("_cos_sin_cache", "_cos_cache", "_sin_cache")
PARALLEL_STATE = "vllm_ascend.distributed.parallel_state"
COVERED = UNQUANTIZED | {"AscendUnquantizedLinearMethod", "AscendUnquantizedEmbeddingMethod", "AscendLinearMethod",
                         "AscendW8A8LinearMethod", "AscendUnquantizedFusedMoEMethod", "AscendFusedMoEMethod"}
W8A8_SCALES = AttrSpec(("AscendW8A8LinearMethod", "AscendLinearMethod"),
                       ("aclnn_input_scale", "aclnn_input_scale_reciprocal", "aclnn_input_offset", "deq_scale",
                        "quant_bias"))


def available() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("torch_npu", "vllm_ascend"))


def _torch_npu():
    return importlib.import_module("torch_npu")


def layout_of(t: torch.Tensor) -> str:
    if t.device.type != "npu":
        return "nd"
    return NZ if _torch_npu().get_npu_format(t) == ACL_FORMAT_FRACTAL_NZ else "nd"


def to_nz(t: torch.Tensor) -> torch.Tensor:
    return _torch_npu().npu_format_cast(t, ACL_FORMAT_FRACTAL_NZ)


def rerecord_rope(model: nn.Module) -> None:
    """Point vllm-ascend's RoPE globals at the restored buffer of the first rotary module."""
    rope = importlib.import_module(ROPE_MODULE)
    first = next((m for m in model.modules() if isinstance(getattr(m, "cos_sin_cache", None), torch.Tensor)), None)
    if first is None:
        return
    for name in ROPE_GLOBALS:
        if hasattr(rope, name):
            setattr(rope, name, None)
    if hasattr(rope, "_record_cos_sin_cache"):
        rope._record_cos_sin_cache(first.cos_sin_cache)
    if hasattr(rope, "_record_cos_and_sin_cache_interleaved"):
        rope._record_cos_and_sin_cache_interleaved(first, first.cos_sin_cache)


def destroy_ascend_groups() -> None:
    importlib.import_module(PARALLEL_STATE).destroy_ascend_model_parallel()


def rebuild_ascend_groups(model: nn.Module, vllm_config) -> None:
    importlib.import_module(PARALLEL_STATE).init_ascend_model_parallel(vllm_config.parallel_config)


def current_groups() -> dict[str, object]:
    from vllm.distributed import get_dp_group, get_ep_group, get_tp_group

    mc2 = importlib.import_module(PARALLEL_STATE).get_mc2_group()
    return {"tp_group": get_tp_group(), "dp_group": get_dp_group(), "ep_group": get_ep_group(), "mc2_group": mc2}


def repoint_moe_groups(model: nn.Module, vllm_config) -> int:
    """Give every MoE layer's ``moe_config`` the groups of the new generation; returns how many."""
    fresh = current_groups()
    count = 0
    for module in model.modules():
        cfg = getattr(module, "moe_config", None)
        if cfg is not None and hasattr(cfg, "mc2_group"):
            for name, group in fresh.items():
                setattr(cfg, name, group)
            count += 1
    return count


def ascend_entry() -> PlatformEntry:
    if not available():
        raise PodsnapError("vLLM runs on an NPU but torch_npu or vllm_ascend cannot be imported; install "
                           "vllm-ascend (podsnap's Ascend entry needs both)")
    version = getattr(importlib.import_module("vllm_ascend"), "__version__", "unknown")
    return PlatformEntry("npu", COVERED, attrs=(ATTENTION_SCALES, W8A8_SCALES), layout_of=layout_of,
                         to_layout={NZ: to_nz}, after_restore=(rerecord_rope,),
                         before_teardown=(destroy_ascend_groups,),
                         after_rebuild=(rebuild_ascend_groups, repoint_moe_groups),
                         versions=f"vllm-ascend {version}", verified=False)
