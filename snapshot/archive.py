"""Checkpoint archives: the tar layout CRI-O and containerd write (and `checkpointctl` reads), plus a podsnap file.

::

    checkpoint/        CRIU's images of the container's processes (no device memory: see podsnap.json)
    config.dump        the container's config (id, name, image, runtime, created/checkpointed times)
    spec.dump          an OCI runtime spec with the Kubernetes annotations (container, pod, namespace)
    stats-dump         CRIU's dump statistics
    dump.log           CRIU's dump log
    podsnap.json       which engine snapshot in which store holds the tensors; pid, pod, engine answer

The tensors are not copied into the archive: ``podsnap.json`` references the
content-addressed snapshot the engine wrote to the store when it paused, and
a restore maps them back from there. An archive is written to a temporary
file next to its final name, fsynced and linked into place (an existing file
is never replaced); on any failure the temporary file is removed. Archives
are 0600: CRIU images hold process memory.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from podsnap.errors import PodsnapError

from .store import fsync_dir

CHECKPOINT_DIR = "checkpoint"
CONFIG_DUMP = "config.dump"
SPEC_DUMP = "spec.dump"
STATS_DUMP = "stats-dump"
DUMP_LOG = "dump.log"
PODSNAP_FILE = "podsnap.json"
FORMAT = 1


class LocationRefused(PodsnapError):
    """A checkpoint location outside the checkpoint directory, or not a .tar file name."""


class ArchiveExists(PodsnapError):
    pass


@dataclass(frozen=True)
class ArchiveInfo:
    """podsnap.json: what a restore needs besides the CRIU images."""
    container_id: str
    container_name: str
    pod_name: str
    namespace: str
    pid: int
    store: str | None
    snapshot: str | None
    engine: dict = field(default_factory=dict)  # the plugin's pause answer: device, rank, snapshot, bytes
    checkpointed_at: float = 0.0
    image_bytes: int = 0
    format: int = FORMAT

    @classmethod
    def from_json(cls, text: str, source: str) -> ArchiveInfo:
        try:
            data = json.loads(text)
            if data.get("format") != FORMAT:
                raise ValueError(f"format {data.get('format')!r}, this podsnap reads format {FORMAT}")
            return cls(**data)
        except (ValueError, TypeError, AttributeError) as e:
            raise PodsnapError(f"{source} is not a podsnap checkpoint archive ({e})") from None


def confine(location: str, root: Path, suffix: str = ".tar") -> Path:
    """``location`` resolved (symlinks included) and checked to lie inside ``root``; it must end in
    ``suffix`` (a file) or, with ``suffix=""``, name a directory. Raises LocationRefused."""
    if not location or "\0" in location or not os.path.isabs(location):
        raise LocationRefused(f"location {location!r} is not an absolute path under the checkpoint directory {root}")
    name = os.path.basename(location)
    if not name or name.startswith(".") or (suffix and not name.endswith(suffix)) or name == suffix:
        what = f"a file name ending in {suffix}" if suffix else "a directory name"
        raise LocationRefused(f"location {location!r} must end in {what} (not starting with '.')")
    real_root = Path(os.path.realpath(root))
    parent = Path(os.path.realpath(os.path.dirname(location)))
    if parent != real_root and real_root not in parent.parents:
        raise LocationRefused(f"location {location!r} resolves to {parent / name}, outside the checkpoint "
                              f"directory {real_root}")
    if not parent.is_dir():
        raise LocationRefused(f"location {location!r}: directory {parent} does not exist")
    final = parent / name
    if final.is_symlink():
        raise LocationRefused(f"location {location!r} is a symbolic link; give a new file name")
    return final


def iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def config_dump(info: ArchiveInfo, created: float) -> dict:
    return {"id": info.container_id, "name": info.container_name, "rootfsImage": "", "rootfsImageRef": "",
            "rootfsImageName": "podsnap-engine", "runtime": "podsnap", "createdTime": iso(created),
            "checkpointedTime": iso(info.checkpointed_at), "restoredTime": "0001-01-01T00:00:00Z",
            "restored": False}


def spec_dump(info: ArchiveInfo, cmdline: list[str], created: float) -> dict:
    annotations = {
        "io.kubernetes.cri.container-name": info.container_name,
        "io.kubernetes.cri.sandbox-name": info.pod_name,
        "io.kubernetes.cri.sandbox-namespace": info.namespace,
        "io.kubernetes.pod.name": info.pod_name,
        "io.kubernetes.pod.namespace": info.namespace,
        "io.kubernetes.container.name": info.container_name,
        "io.podsnap.created": iso(created),
        "io.podsnap.store": info.store or "",
        "io.podsnap.snapshot": info.snapshot or "",
    }
    return {"ociVersion": "1.0.2", "process": {"args": cmdline, "cwd": "/"}, "root": {"path": "/"},
            "annotations": annotations}


def process_cmdline(pid: int) -> list[str]:
    try:
        return [a for a in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0") if a]
    except OSError:
        return []


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes, mtime: float) -> None:
    member = tarfile.TarInfo(name)
    member.size, member.mode, member.mtime = len(data), 0o600, int(mtime)
    tar.addfile(member, io.BytesIO(data))


def write_archive(location: Path, images: Path, info: ArchiveInfo, *, created: float, cmdline: list[str],
                  check: Callable[[], None] = lambda: None) -> int:
    """Write the archive of the dumped container at ``location`` (checked with ``confine``); returns its size.
    ``check`` is called between files and may raise (a deadline): nothing is left behind then."""
    tmp = location.with_name(f".{location.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            with tarfile.open(fileobj=f, mode="w", format=tarfile.PAX_FORMAT) as tar:
                tar.add(images, arcname=CHECKPOINT_DIR, recursive=False)
                for p in sorted(images.iterdir()):
                    check()
                    if p.is_file() and p.name not in (STATS_DUMP, DUMP_LOG):  # those two go at the top
                        tar.add(p, arcname=f"{CHECKPOINT_DIR}/{p.name}")
                now = info.checkpointed_at
                _add_bytes(tar, CONFIG_DUMP, json.dumps(config_dump(info, created)).encode(), now)
                _add_bytes(tar, SPEC_DUMP, json.dumps(spec_dump(info, cmdline, created)).encode(), now)
                for name in (STATS_DUMP, DUMP_LOG):
                    if (images / name).exists():
                        tar.add(images / name, arcname=name)
                _add_bytes(tar, PODSNAP_FILE, json.dumps(asdict(info), indent=1).encode(), now)
            f.flush()
            os.fsync(f.fileno())
        check()
        try:
            os.link(tmp, location)  # never replaces an archive
        except FileExistsError:
            raise ArchiveExists(f"{location} already exists; the kubelet names each checkpoint uniquely, "
                                "so give a new location") from None
        fsync_dir(location.parent)
        return location.stat().st_size
    finally:
        tmp.unlink(missing_ok=True)


def read_info(archive: Path) -> ArchiveInfo:
    """podsnap.json of an archive (without unpacking the images)."""
    try:
        with tarfile.open(archive, "r:") as tar:
            member = tar.extractfile(PODSNAP_FILE)
            text = member.read().decode() if member else ""
    except (OSError, tarfile.TarError, KeyError) as e:
        raise PodsnapError(f"{archive} is not a podsnap checkpoint archive ({e})") from None
    return ArchiveInfo.from_json(text, str(archive))


def extract_images(archive: Path, dest: Path) -> Path:
    """Unpack ``checkpoint/`` of ``archive`` into ``dest`` (a new private directory); returns the images dir."""
    dest.mkdir(mode=0o700, parents=True)
    try:
        with tarfile.open(archive, "r:") as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(f"{CHECKPOINT_DIR}/") and m.isfile()]
            tar.extractall(dest, members=members, filter="data")
    except (OSError, tarfile.TarError) as e:
        raise PodsnapError(f"cannot unpack the CRIU images of {archive} ({e})") from None
    images = dest / CHECKPOINT_DIR
    os.chmod(images, 0o700)
    return images
