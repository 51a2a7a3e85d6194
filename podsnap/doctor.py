"""``podsnap doctor``: what works on this node for process checkpoints, and the command that fixes the rest."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass

from podsnap.errors import PodsnapError

INSTALL_CRIU = "bash deploy/install-criu.sh"


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str | None = None


def check_criu() -> list[Check]:
    from podsnap.criu_plugin import tools

    try:
        criu = tools.criu_binary()
        version = tools.criu_version(criu)
    except (PodsnapError, OSError) as e:
        return [Check("criu", False, str(e), INSTALL_CRIU)]
    vtext = ".".join(map(str, version))
    out = [Check("criu version", version >= (4, 0), f"{vtext} at {criu}",
                 None if version >= (4, 0) else f"CRIU >= 4.0 is needed: {INSTALL_CRIU}")]
    done = subprocess.run([str(criu), "check"], capture_output=True, text=True)
    said = (done.stdout + done.stderr).strip().splitlines()
    out.append(Check("criu check", done.returncode == 0, said[-1] if said else f"exit {done.returncode}",
                     None if done.returncode == 0 else f"run `{criu} check` as root for the reason"))
    try:
        out.append(Check("criu plugin", True, str(tools.build_plugin())))
    except PodsnapError as e:
        out.append(Check("criu plugin", False, str(e).splitlines()[0], INSTALL_CRIU))
    ctl = tools.checkpointctl_binary()
    out.append(Check("checkpointctl", ctl is not None, str(ctl) if ctl else "not found",
                     None if ctl else INSTALL_CRIU))
    return out


def check_netns() -> Check:
    name = f"podsnap-doctor-{os.getpid()}"
    try:
        add = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    except FileNotFoundError:
        return Check("network namespaces", False, "`ip` not found", "apt-get install iproute2")
    if add.returncode != 0:
        return Check("network namespaces", False, add.stderr.strip() or "ip netns add failed",
                     "run as root (CAP_SYS_ADMIN) to create pod network namespaces")
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return Check("network namespaces", True, "can create and delete one")


def check_hook_dir() -> Check:
    from podsnap.criu_plugin.hooks import hook_dir

    d = hook_dir()
    probe = d if d.exists() else next((p for p in d.parents if p.exists()), d)
    ok = os.access(probe, os.W_OK)
    return Check("device-hook dir", ok, str(d),
                 None if ok else f"make {d} writable for the engine's user, or set PODSNAP_HOOK_DIR")


def check_torch() -> Check:
    import torch

    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    try:
        import torch_npu  # noqa: F401

        devices.append("npu")
    except ImportError:
        pass
    return Check("torch", True, f"{torch.__version__}, devices: {', '.join(devices)}")


def run_checks() -> list[Check]:
    return [*check_criu(), check_netns(), check_hook_dir(), check_torch()]
