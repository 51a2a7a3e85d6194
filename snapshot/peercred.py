"""The agent's public Unix socket: file permissions plus a SO_PEERCRED check on every connection.

grpcio does not expose a caller's credentials to Python, so the gRPC server
listens on a private socket in a 0700 directory and this guard owns the
public one (mode 0600 or 0660, optionally group-owned): it accepts each
connection, reads the peer's pid/uid/gid with ``SO_PEERCRED`` (the kernel's
record of who connected, not something the client claims), closes it unless
the policy allows that uid/gid, and otherwise splices bytes both ways between
the caller and the private socket.
"""

from __future__ import annotations

import os
import socket
import stat
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from podsnap.errors import PodsnapError

ALLOWED_MODES = (0o600, 0o660)
CHUNK = 256 << 10


@dataclass(frozen=True)
class Peer:
    pid: int
    uid: int
    gid: int


def peer_credentials(conn: socket.socket) -> Peer:
    pid, uid, gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return Peer(pid, uid, gid)


@dataclass(frozen=True)
class AccessPolicy:
    """Root and the agent's own user are always allowed; ``uids``/``gids`` add more callers."""
    uids: frozenset[int] = frozenset()
    gids: frozenset[int] = frozenset()

    def allows(self, peer: Peer) -> bool:
        return peer.uid in (0, os.getuid()) or peer.uid in self.uids or peer.gid in self.gids


@dataclass
class GuardStats:
    accepted: int = 0
    refused: list[Peer] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def bind_unix(path: Path, mode: int, group: int | None = None) -> socket.socket:
    """A listening Unix socket at ``path`` created with ``mode`` (no window with wider permissions)."""
    if mode not in ALLOWED_MODES:
        raise PodsnapError(f"socket mode {mode:#o} is not allowed: use 0600 (owner only) or 0660 (owner and group)")
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise PodsnapError(f"{path} exists and is not a socket; remove it or choose another --socket")
        path.unlink()  # left behind by an agent that died
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o777 & ~mode)
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    if group is not None:
        os.chown(path, -1, group)
    os.chmod(path, mode)
    sock.listen(64)
    return sock


class PeerCredGuard:
    """Accepts on ``public``, checks each peer, forwards allowed connections to ``private``."""

    def __init__(self, public: Path, private: Path, policy: AccessPolicy, mode: int = 0o600,
                 group: int | None = None, on_refused: Callable[[Peer], None] | None = None):
        self.public, self.private, self.policy = Path(public), Path(private), policy
        self.on_refused = on_refused
        self.stats = GuardStats()
        self.sock = bind_unix(self.public, mode, group)
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self._accept_loop, name="podsnap-agent-guard", daemon=True)
        self.thread.start()

    def _accept_loop(self) -> None:
        while not self.closed.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            peer = peer_credentials(conn)
            if not self.policy.allows(peer):
                with self.stats.lock:
                    self.stats.refused.append(peer)
                if self.on_refused:
                    self.on_refused(peer)
                conn.close()
                continue
            with self.stats.lock:
                self.stats.accepted += 1
            threading.Thread(target=self._forward, args=(conn,), name="podsnap-agent-splice", daemon=True).start()

    def _forward(self, conn: socket.socket) -> None:
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            upstream.connect(str(self.private))
        except OSError:
            conn.close()
            upstream.close()
            return
        back = threading.Thread(target=pump, args=(upstream, conn), daemon=True)
        back.start()
        pump(conn, upstream)
        back.join()
        conn.close()
        upstream.close()

    def close(self) -> None:
        self.closed.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        try:
            self.public.unlink()
        except FileNotFoundError:
            pass


def pump(src: socket.socket, dst: socket.socket) -> None:
    """Copy ``src`` to ``dst`` until EOF or an error, then half-close ``dst``."""
    try:
        while data := src.recv(CHUNK):
            dst.sendall(data)
    except OSError:
        pass
    try:
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        pass
