"""Shared fixtures: tiny HF checkpoints made once per test session, pod networks, CRIU prerequisites."""

from __future__ import annotations

import ctypes
import os
import subprocess
from pathlib import Path

import pytest
from netns import PodNetwork

from podsnap.engine.tiny import make_tiny
from podsnap.errors import PodsnapError

ARCHS = ["llama", "qwen3", "qwen3-moe"]
PR_SET_CHILD_SUBREAPER = 36


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    """``model_factory(arch, preset="tiny", seed=0, shards=1)`` -> checkpoint dir (cached)."""
    made = {}

    def make(arch: str, preset: str = "tiny", seed: int = 0, shards: int = 1):
        key = (arch, preset, seed, shards)
        if key not in made:
            out = tmp_path_factory.mktemp(f"{arch}-{preset}-s{seed}-k{shards}")
            make_tiny(arch, out, preset, seed, shards)
            made[key] = out
        return made[key]

    return make


@pytest.fixture
def pod_network():
    """Pods as network namespaces on a bridge (tests/netns.py); deleted afterwards."""
    try:
        net = PodNetwork()
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        reason = f"cannot create network namespaces here: {getattr(e, 'stderr', '') or e}"
        if os.environ.get("CI"):
            pytest.fail(reason)
        print(reason)
        pytest.skip(reason)
    try:
        yield net
    finally:
        net.close()
        leftover = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert net.tag not in leftover, "a test network namespace was not deleted"


@pytest.fixture(scope="session")
def tp2_snapshot(model_factory, tmp_path_factory):
    """A TP=2 snapshot "s" of the tiny llama (pods warm-restore from it) and the reference tokens."""
    from pods import make_tp2_snapshot

    store = tmp_path_factory.mktemp("tp2-store")
    return store, make_tp2_snapshot(model_factory("llama"), store)


@pytest.fixture(scope="module")
def criu():
    """CRIU >= 4 and the plugin, built now; restored processes become children of this test process
    (a subreaper), so that they can be reaped by pid."""
    from podsnap.criu_plugin import tools

    try:
        version = tools.criu_version()
        if version < (4, 0):
            raise PodsnapError(f"CRIU {version} is older than 4.0")
        plugin = tools.build_plugin()
    except (PodsnapError, OSError) as e:
        reason = f"CRIU is not usable here: {e}"
        if os.environ.get("CI"):
            pytest.fail(reason)
        print(reason)
        pytest.skip(reason)
    if os.geteuid() != 0:
        if os.environ.get("CI"):
            pytest.fail("CRIU needs root")
        print("CRIU needs root")
        pytest.skip("CRIU needs root")
    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    return plugin


@pytest.fixture
def hook_dir(tmp_path, monkeypatch):
    d = Path(f"/tmp/psh-{os.urandom(3).hex()}")  # short: a unix socket path has at most 107 bytes
    monkeypatch.setenv("PODSNAP_HOOK_DIR", str(d))
    yield d
    subprocess.run(["rm", "-rf", str(d)], check=False)
