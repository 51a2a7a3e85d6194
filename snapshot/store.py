"""The snapshot store: content-addressed blobs and atomically committed manifests.

On a directory that stands for shared storage (a Kubernetes RWX volume)::

    STORE/.podsnap-store        format marker
    STORE/lock                  flock: shared while creating, exclusive for rm/gc
    STORE/blobs/ab/abcd...      one immutable blob per distinct tensor, named by its BLAKE3
    STORE/manifests/ID.json     one committed manifest per snapshot
    STORE/tmp/                  writes in progress (gc removes leftovers)

Each tensor is its own blob, so it starts at offset 0 (page-aligned) and can
be memory-mapped; identical tensors (across ranks, replicas, snapshots) are
stored once. A blob is written to tmp/, fsynced and renamed into place; a
manifest is written, fsynced, linked into manifests/ (never replacing one)
and the directory fsynced. A snapshot is visible only once its manifest is
there, so a crash at any point leaves earlier snapshots intact and no half
snapshot listed. Files are 0600 and directories 0700: blobs hold memory.
"""

from __future__ import annotations

import fcntl
import os
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import blake3

from podsnap.errors import PodsnapError

from .manifest import Manifest, ManifestError

FORMAT = "podsnap-store 1\n"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
HASH_RE = re.compile(r"^[0-9a-f]{64}$")
READ_CHUNK = 16 << 20


class StoreError(PodsnapError):
    pass


def hash_bytes(data) -> str:
    return blake3.blake3(data, max_threads=blake3.blake3.AUTO).hexdigest()


def check_snapshot_id(snapshot_id: str) -> str:
    if not isinstance(snapshot_id, str) or not NAME_RE.match(snapshot_id) or snapshot_id.endswith(".json"):
        raise StoreError(f"snapshot name {snapshot_id!r} is not valid: use 1-128 letters, digits, '.', '_' "
                         "or '-', starting with a letter or digit")
    return snapshot_id


def new_snapshot_id() -> str:
    return time.strftime("snap-%Y%m%d-%H%M%S-") + os.urandom(2).hex()


def write_private(path: Path, data) -> None:
    """Create ``path`` (it must not exist) readable by its owner only, write ``data``, fsync."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        view = memoryview(data).cast("B")
        while view:
            n = os.write(fd, view[:1 << 30])
            view = view[n:]
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data) -> None:
    """Replace ``path`` with ``data`` so readers see the old or the new file, never a part."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}")
    write_private(tmp, data)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def mkdir_private(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)


@dataclass
class GcResult:
    blobs_removed: int
    bytes_freed: int
    tmp_removed: int


SUBDIRS = ("blobs", "manifests", "tmp", "fpcache", "processes")
OWN_ENTRIES = {*SUBDIRS, "lock", "init.lock", ".podsnap-store", "lost+found"}


class Store:
    def __init__(self, root: str | Path, create: bool = True):
        self.root = Path(root)
        if not (self.root / ".podsnap-store").exists():
            if not create:
                raise StoreError(f"{self.root} is not a podsnap store (no .podsnap-store marker); "
                                 "create one with `podsnap snapshot create --store DIR ...`")
            self._initialize()
        for sub in SUBDIRS:
            if not (self.root / sub).is_dir():
                mkdir_private(self.root / sub)
        self.blobs_dir = self.root / "blobs"
        self.manifests_dir = self.root / "manifests"
        self.tmp_dir = self.root / "tmp"
        self.fpcache_dir = self.root / "fpcache"

    def _initialize(self) -> None:
        """Make ``root`` a store; safe when several ranks open a new store at once."""
        mkdir_private(self.root)
        fd = os.open(self.root / "init.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if (self.root / ".podsnap-store").exists():
                return
            foreign = sorted(p.name for p in self.root.iterdir()
                             if p.name not in OWN_ENTRIES and not p.name.lstrip(".").startswith("podsnap-store."))
            if foreign:
                raise StoreError(f"{self.root} is not empty ({', '.join(foreign[:3])}, ...) and is not a "
                                 "podsnap store; give an empty or new directory")
            for sub in SUBDIRS:
                mkdir_private(self.root / sub)
            write_atomic(self.root / ".podsnap-store", FORMAT.encode())
        finally:
            os.close(fd)

    def process_dir(self, name: str, pid: int | None = None) -> Path:
        """Where the CRIU images of process checkpoint ``name`` go (one subdirectory per process)."""
        path = self.root / "processes" / check_snapshot_id(name)
        return path if pid is None else path / f"pid-{int(pid)}"

    # --- locking --------------------------------------------------------------

    @contextmanager
    def lock(self, exclusive: bool):
        """Shared: creators (they only add). Exclusive: rm and gc (they delete)."""
        fd = os.open(self.root / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)  # releases the lock, also when the process dies

    # --- blobs ----------------------------------------------------------------

    def blob_path(self, digest: str) -> Path:
        if not HASH_RE.match(digest):
            raise StoreError(f"{digest!r} is not a blob hash")
        return self.blobs_dir / digest[:2] / digest

    def has_blob(self, digest: str) -> bool:
        return self.blob_path(digest).exists()

    def put_blob(self, data, digest: str | None = None) -> tuple[str, bool]:
        """Store ``data`` (bytes-like) under its hash; returns (hash, whether bytes were written)."""
        digest = digest or hash_bytes(data)
        path = self.blob_path(digest)
        if path.exists():
            return digest, False
        mkdir_private(path.parent)
        tmp = self.tmp_dir / f"{digest}.{os.getpid()}.{os.urandom(4).hex()}"
        write_private(tmp, data)
        os.rename(tmp, path)  # atomic; a concurrent writer of the same content is harmless
        return digest, True

    def verify_blob(self, digest: str, length: int) -> str | None:
        """None if the blob holds exactly ``length`` bytes hashing to ``digest``; else what is wrong."""
        path = self.blob_path(digest)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return f"blob {path} is missing"
        if size != length:
            return f"blob {path} has {size} bytes, expected {length} (truncated?)"
        h = blake3.blake3(max_threads=blake3.blake3.AUTO)
        with open(path, "rb", buffering=0) as f:
            while chunk := f.read(READ_CHUNK):
                h.update(chunk)
        if h.hexdigest() != digest:
            return f"blob {path} does not hash to its name (corrupt)"
        return None

    # --- manifests ------------------------------------------------------------

    def manifest_path(self, snapshot_id: str) -> Path:
        return self.manifests_dir / f"{check_snapshot_id(snapshot_id)}.json"

    def commit(self, manifest: Manifest) -> None:
        """Make the snapshot visible: every blob it names must already be durable."""
        missing = [b for b in manifest.blobs() if not self.has_blob(b)]
        if missing:
            raise StoreError(f"cannot commit {manifest.snapshot_id}: {len(missing)} blob(s) missing, e.g. {missing[0]}")
        for d in {self.blob_path(b).parent for b in manifest.blobs()}:
            fsync_dir(d)
        final = self.manifest_path(manifest.snapshot_id)
        tmp = self.tmp_dir / f"{manifest.snapshot_id}.{os.getpid()}.manifest"
        write_private(tmp, manifest.to_json().encode())
        try:
            os.link(tmp, final)  # fails if the name is taken: a commit never replaces a snapshot
        except FileExistsError:
            raise StoreError(f"a snapshot named {manifest.snapshot_id!r} already exists in {self.root}; "
                             "choose another --name or remove it first") from None
        finally:
            os.unlink(tmp)
        fsync_dir(self.manifests_dir)

    def load(self, snapshot_id: str) -> Manifest:
        path = self.manifest_path(snapshot_id)
        try:
            text = path.read_text()
        except FileNotFoundError:
            known = ", ".join(self.list_ids()[-5:]) or "none"
            raise StoreError(f"no snapshot {snapshot_id!r} in {self.root} (latest: {known})") from None
        except UnicodeDecodeError:
            raise ManifestError(f"manifest {path} is not text (corrupt)") from None
        manifest = Manifest.from_json(text, source=f"manifest {path}")
        if manifest.snapshot_id != snapshot_id:
            raise ManifestError(f"manifest {path} names snapshot {manifest.snapshot_id!r}, not {snapshot_id!r}")
        return manifest

    def list_ids(self) -> list[str]:
        """Committed snapshots, oldest first."""
        paths = [p for p in self.manifests_dir.glob("*.json") if NAME_RE.match(p.stem)]
        return [p.stem for p in sorted(paths, key=lambda p: (p.stat().st_mtime, p.name))]

    def manifests(self) -> list[Manifest]:
        return [self.load(i) for i in self.list_ids()]

    def referenced_blobs(self, exclude: str | None = None) -> set[str]:
        refs: set[str] = set()
        for i in self.list_ids():
            if i != exclude:
                refs |= self.load(i).blobs()
        return refs

    def remove(self, snapshot_id: str) -> GcResult:
        """Delete a snapshot and the blobs no other snapshot references."""
        with self.lock(exclusive=True):
            manifest = self.load(snapshot_id)
            keep = self.referenced_blobs(exclude=snapshot_id)
            os.unlink(self.manifest_path(snapshot_id))
            fsync_dir(self.manifests_dir)
            return self._delete_blobs(manifest.blobs() - keep, tmp_removed=0)

    def gc(self) -> GcResult:
        """Delete blobs no snapshot references and leftovers of interrupted writes."""
        with self.lock(exclusive=True):
            keep = self.referenced_blobs()
            present = {p.name for p in self.blobs_dir.glob("*/*") if HASH_RE.match(p.name)}
            tmp = list(self.tmp_dir.iterdir())
            for p in tmp:
                p.unlink()
            return self._delete_blobs(present - keep, tmp_removed=len(tmp))

    def _delete_blobs(self, digests: set[str], tmp_removed: int) -> GcResult:
        freed = 0
        for d in digests:
            path = self.blob_path(d)
            try:
                freed += path.stat().st_size
                path.unlink()
            except FileNotFoundError:
                pass
        return GcResult(len(digests), freed, tmp_removed)
