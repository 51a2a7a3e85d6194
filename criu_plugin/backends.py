"""Device backends: what a process checkpoint does with the accelerator of an engine.

Every backend first drops the engine's tensors (weights, derived tables, KV
cache: they are in the snapshot store, so they stay out of the CRIU image)
and maps them back from the store on resume. What remains differs:

- ``cpu``: nothing; the process image holds only Python, torch and the
  engine's small bookkeeping. Tested here, end to end with CRIU.
- ``cuda``: the CUDA context survives the drop; the CRIU plugin locks and
  checkpoints it with ``cuda-checkpoint`` (and restores and unlocks it before
  the engine resumes), as CRIU's own CUDA plugin does. Not verified on these
  machines (no GPU).
- ``ascend``: the drop frees NPU memory (``torch.npu.empty_cache``); resume
  moves the tensors to the NPU and casts NZ weights back with
  ``torch_npu.npu_format_cast(w, 29)``. The CANN-level context snapshot that
  vllm-ascend's GRUS RFC describes is not driven from here. Not verified (no
  NPU); ``torch_npu`` is imported only when this backend is chosen.

The name a backend reports is what the engine answers the plugin's "pause"
with; the plugin acts on "cuda" and treats anything else like "cpu".
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc

import torch

from podsnap.errors import PodsnapError

ACL_FORMAT_FRACTAL_NZ = 29


M_MMAP_THRESHOLD = -3


def _libc():
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name else None


def map_large_allocations(threshold: int = 1 << 20) -> None:
    """Serve allocations above ``threshold`` with their own mappings (glibc): freed, they leave the
    process at once. Without a fixed threshold glibc raises it up to 32 MiB as large blocks are freed,
    and later tensor-sized buffers stay in arenas that a checkpoint would dump."""
    libc = _libc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(M_MMAP_THRESHOLD, threshold)


def return_freed_memory() -> None:
    """Hand freed heap pages back to the kernel, so CRIU does not dump them."""
    gc.collect()
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):  # glibc
        libc.malloc_trim(0)


class CpuBackend:
    name = "cpu"
    device = "cpu"

    def release(self, engine) -> int:
        freed = engine.drop_state()
        self.empty_cache()
        return freed

    def reacquire(self, engine, tensors: dict[str, torch.Tensor]) -> None:
        engine.refill_state({name: self.to_device(name, t) for name, t in tensors.items()})

    def empty_cache(self) -> None:
        return_freed_memory()

    def to_device(self, name: str, t: torch.Tensor) -> torch.Tensor:
        return t


class CudaBackend(CpuBackend):
    name = "cuda"
    device = "cuda"

    def empty_cache(self) -> None:
        torch.cuda.synchronize()
        super().empty_cache()
        torch.cuda.empty_cache()

    def to_device(self, name: str, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, non_blocking=True)


class AscendBackend(CpuBackend):
    name = "ascend"
    device = "npu"

    def __init__(self, nz_names: set[str] | None = None):
        try:
            import torch_npu  # noqa: F401  (registers torch.npu)
        except ImportError:
            raise PodsnapError("the ascend device backend needs torch_npu (CANN); it is not installed") from None
        self.nz_names = nz_names or set()

    def empty_cache(self) -> None:
        torch.npu.synchronize()
        super().empty_cache()
        torch.npu.empty_cache()

    def to_device(self, name: str, t: torch.Tensor) -> torch.Tensor:
        import torch_npu

        t = t.to(self.device)
        return torch_npu.npu_format_cast(t, ACL_FORMAT_FRACTAL_NZ) if name in self.nz_names else t


BACKENDS = {"cpu": CpuBackend, "cuda": CudaBackend, "ascend": AscendBackend}


def get_backend(name: str):
    if name not in BACKENDS:
        raise PodsnapError(f"unknown device backend {name!r}; valid: {', '.join(BACKENDS)}")
    return BACKENDS[name]()


def backend_for(engine):
    """The backend of the device the engine's weights live on."""
    device = next((t.device.type for t in engine.model.parameters() if not t.is_meta), "cpu")
    return get_backend({"npu": "ascend"}.get(device, device))
