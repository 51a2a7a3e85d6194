"""Where CRIU, checkpointctl and podsnap's plugin are, and building the plugin.

Lookup order for the binaries: ``PODSNAP_CRIU`` / ``PODSNAP_CHECKPOINTCTL``,
then the development prefix that ``deploy/install-criu.sh`` fills
(``.deps/criu/bin`` in the repository), then ``PATH``. The plugin is built
from ``podsnap_criu.c`` (shipped with the package) into
``PODSNAP_CRIU_PLUGIN_DIR`` (default ``.deps/criu/plugins``); CRIU loads every
plugin in the directory given with ``-L``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from podsnap.errors import PodsnapError

SOURCE = Path(__file__).with_name("podsnap_criu.c")
REPO = Path(__file__).resolve().parents[1]
DEV_PREFIX = Path(os.environ.get("PODSNAP_CRIU_PREFIX") or REPO / ".deps" / "criu")
PLUGIN_NAME = "podsnap_criu.so"
INSTALL_HINT = "run `bash deploy/install-criu.sh` (or install CRIU >= 4.0 from your distribution)"


def _find(env: str, name: str) -> Path | None:
    if os.environ.get(env):
        return Path(os.environ[env])
    dev = DEV_PREFIX / "bin" / name
    if dev.exists():
        return dev
    found = shutil.which(name)
    return Path(found) if found else None


def criu_binary() -> Path:
    path = _find("PODSNAP_CRIU", "criu")
    if path is None:
        raise PodsnapError(f"CRIU is not installed: {INSTALL_HINT}")
    return path


def checkpointctl_binary() -> Path | None:
    return _find("PODSNAP_CHECKPOINTCTL", "checkpointctl")


def criu_version(criu: Path | None = None) -> tuple[int, int, int]:
    out = subprocess.run([str(criu or criu_binary()), "--version"], capture_output=True, text=True).stdout
    m = re.search(r"Version:\s*(\d+)\.(\d+)(?:\.(\d+))?", out)
    if not m:
        raise PodsnapError(f"cannot tell the CRIU version from `criu --version`: {out.strip()[:200]!r}")
    return int(m[1]), int(m[2]), int(m[3] or 0)


def criu_include_dir() -> Path | None:
    """Where ``criu/criu-plugin.h`` is (libcriu-dev)."""
    for d in (DEV_PREFIX / "include", Path("/usr/include")):
        if (d / "criu" / "criu-plugin.h").exists():
            return d
    return None


def plugin_dir() -> Path:
    return Path(os.environ.get("PODSNAP_CRIU_PLUGIN_DIR") or DEV_PREFIX / "plugins")


def plugin_path() -> Path:
    return plugin_dir() / PLUGIN_NAME


def build_plugin(out_dir: Path | None = None, cc: str | None = None) -> Path:
    """Compile ``podsnap_criu.c`` into ``out_dir/podsnap_criu.so`` (rebuilt only when the source is newer)."""
    out_dir = out_dir or plugin_dir()
    out = out_dir / PLUGIN_NAME
    if out.exists() and out.stat().st_mtime >= SOURCE.stat().st_mtime:
        return out
    include = criu_include_dir()
    if include is None:
        raise PodsnapError(f"criu/criu-plugin.h not found (libcriu-dev): {INSTALL_HINT}")
    cc = cc or os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        raise PodsnapError(f"no C compiler {cc!r} to build the CRIU plugin: install gcc (apt-get install gcc)")
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    cmd = [cc, "-O2", "-Wall", "-Werror", "-fPIC", "-shared", f"-I{include}", "-o", str(tmp), str(SOURCE)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise PodsnapError(f"building the CRIU plugin failed ({' '.join(cmd)}):\n{done.stderr.strip()}")
    os.replace(tmp, out)
    return out


if __name__ == "__main__":  # python -m podsnap.criu_plugin.tools: build the plugin (deploy scripts)
    try:
        print(build_plugin())
    except PodsnapError as e:
        sys.exit(f"error: {e}")
