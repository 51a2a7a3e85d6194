"""The distribution: one `podsnap` wheel whose parts import as podsnap.<dir>."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = ["engine", "snapshot", "criu_plugin", "restore", "comm_rebuild", "engine_hooks"]


def test_wheel_maps_each_directory_to_a_subpackage(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    str(ROOT), "-w", str(tmp_path)], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("podsnap-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for part in PARTS:
        assert f"podsnap/{part}/__init__.py" in names
    assert "podsnap/engine/model.py" in names and "podsnap/cli.py" in names
    assert not any(n.startswith(("engine/", "tests/")) for n in names)  # nothing at the top level


def test_subpackages_import_from_the_installed_tree():
    import podsnap.engine.model as model

    assert Path(model.__file__).resolve() == ROOT / "engine" / "model.py"
