"""The device-hook socket: where the CRIU plugin reaches a running engine.

Each engine process listens on ``HOOK_DIR/<pid>.sock`` (``PODSNAP_HOOK_DIR``,
default ``/run/podsnap/hooks``; the directory is 0700, the socket 0600). The
plugin (``podsnap_criu.c``) connects for each CRIU hook of that pid, sends one
line and reads one line back:

    pause            -> "ok <device>" once the engine has quiesced and dropped
                        its tensors and communicators, or "error <why>"
    resume <meta|->  -> "ok <device>" at once; the engine maps its tensors back
                        and rebuilds communication on its own thread

Only root or the engine's own user may connect (SO_PEERCRED). The server
closes each connection right after its reply, so that no connection to CRIU is
left open in the image.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_HOOK_DIR = "/run/podsnap/hooks"


def hook_dir() -> Path:
    return Path(os.environ.get("PODSNAP_HOOK_DIR") or DEFAULT_HOOK_DIR)


def hook_socket_path(pid: int) -> Path:
    return hook_dir() / f"{pid}.sock"


def send_request(pid: int, line: str, wait_reply: bool = True, timeout_s: float | None = 120) -> str:
    """The plugin's side of the protocol, for the agent: send one line to engine ``pid``'s hook socket and
    return its reply ("" with ``wait_reply=False``). Raises OSError if the engine does not listen."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        s.connect(str(hook_socket_path(pid)))
        s.sendall(line.encode() + b"\n")
        s.shutdown(socket.SHUT_WR)
        return s.makefile("r").readline().strip() if wait_reply else ""


def peer_uid(conn: socket.socket) -> int:
    _pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return uid


@dataclass
class HookEvents:
    """What the engine received from CRIU, in order (for logs, /metrics and tests)."""
    events: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, event: str) -> None:
        with self.lock:
            self.events.append(event)

    def snapshot(self) -> list[str]:
        with self.lock:
            return list(self.events)


class DeviceHookServer:
    """Serves the plugin's requests on a daemon thread.

    ``on_pause()`` runs on the hook thread and returns the device name once
    the engine is quiesced and its state dropped (it raises to refuse: the
    dump then fails and the engine keeps running). ``on_resume(metadata)``
    must return at once; the engine resumes on its own thread.
    """

    def __init__(self, on_pause: Callable[[], str], on_resume: Callable[[str | None], None]):
        self.on_pause = on_pause
        self.on_resume = on_resume
        self.events = HookEvents()
        self.path = hook_socket_path(os.getpid())
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.path.parent, 0o700)
        if self.path.exists():
            self.path.unlink()  # left by a dead process that had our pid
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)
        try:
            self.sock.bind(str(self.path))
        finally:
            os.umask(old_umask)
        self.sock.listen(8)
        self.thread = threading.Thread(target=self._serve, name="podsnap-device-hooks", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            with conn:
                self._handle(conn)

    def _handle(self, conn: socket.socket) -> None:
        uid = peer_uid(conn)
        if uid not in (0, os.getuid()):
            conn.sendall(f"error uid {uid} may not control this engine\n".encode())
            return
        conn.settimeout(10)
        try:
            request = conn.makefile("r").readline().strip()
        except OSError:
            return
        verb, _, arg = request.partition(" ")
        try:
            if verb == "pause":
                self.events.add("pause")
                reply = f"ok {self.on_pause()}"
            elif verb == "resume":
                self.events.add("resume")
                self.on_resume(None if arg in ("", "-") else arg)
                reply = "ok"
            else:
                reply = f"error unknown request {request[:80]!r}; expected 'pause' or 'resume <metadata>'"
        except Exception as e:  # noqa: BLE001 - any failure is reported to CRIU, which aborts the dump
            reply = f"error {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:1000]
        try:
            conn.sendall(reply.encode() + b"\n")
        except OSError:
            pass  # the plugin gave up (timeout); it logged why

    def close(self) -> None:
        self.sock.close()
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
