"""Settings of the podsnap model loader, read from vLLM's ``model_loader_extra_config``.

    LLM(model, load_format="podsnap",
        model_loader_extra_config={"store": "/mnt/snapshots", "verify": "full", "fallback": True})
    vllm serve MODEL --load-format podsnap --model-loader-extra-config '{"store": "/mnt/snapshots"}'

``store``      the snapshot store directory (created on first use); ``PODSNAP_STORE`` if not given
``verify``     full | sample | none: hash check of the restored tensors (podsnap.restore.loader)
``fallback``   true (default): a snapshot that does not match this start, or is damaged, is
               reported and vLLM loads the checkpoint as usual; false: the start fails instead
``load_mode``  read | mmap (mmap: CPU only, copy-on-write pages of the store's blobs)
``write``      true (default): after a normal load, write the snapshot so the next start restores
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from podsnap.errors import ConfigError
from podsnap.restore.loader import LOAD_MODES, VERIFY_MODES

KEYS = ("store", "verify", "fallback", "load_mode", "write")


@dataclass(frozen=True)
class LoaderSettings:
    store: Path
    verify: str = "full"
    fallback: bool = True
    load_mode: str = "read"
    write: bool = True

    @classmethod
    def parse(cls, extra: dict | None, env=os.environ) -> LoaderSettings:
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(KEYS))
        if unknown:
            raise ConfigError(f"model_loader_extra_config has unknown key(s) {unknown} for load_format "
                              f"'podsnap'; known: {', '.join(KEYS)}")
        store = extra.get("store") or env.get("PODSNAP_STORE")
        if not store:
            raise ConfigError("load_format 'podsnap' needs a snapshot store: pass model_loader_extra_config="
                              "{'store': '/path/to/store'} or set PODSNAP_STORE")
        settings = cls(Path(store), str(extra.get("verify", "full")), _flag(extra, "fallback", True),
                       str(extra.get("load_mode", "read")), _flag(extra, "write", True))
        if settings.verify not in VERIFY_MODES:
            raise ConfigError(f"podsnap verify={settings.verify!r} is not one of {', '.join(VERIFY_MODES)}")
        if settings.load_mode not in LOAD_MODES:
            raise ConfigError(f"podsnap load_mode={settings.load_mode!r} is not one of {', '.join(LOAD_MODES)}")
        return settings


def _flag(extra: dict, key: str, default: bool) -> bool:
    value = extra.get(key, default)
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    raise ConfigError(f"podsnap {key}={value!r} is not a boolean (true or false)")
