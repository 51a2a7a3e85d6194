"""The vLLM plugin entry point (group ``vllm.general_plugins``, declared in pyproject.toml).

vLLM calls ``register`` in every process it starts (front end, engine core,
workers) before it builds a model, so ``load_format="podsnap"`` resolves to
``PodsnapModelLoader`` everywhere. Nothing else is patched.
"""

from __future__ import annotations

LOAD_FORMAT = "podsnap"


def register() -> None:
    from vllm.model_executor.model_loader import register_model_loader

    from .loader import PodsnapModelLoader

    register_model_loader(LOAD_FORMAT)(PodsnapModelLoader)
