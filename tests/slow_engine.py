"""A process that answers the CRIU plugin's "pause" only once the test allows it (a file appears).

Run as ``python slow_engine.py CONTAINER_ID EVENTS_FILE RELEASE_FILE``: it
registers itself with the agent's registry, serves the real device-hook
socket (``podsnap.criu_plugin.hooks.DeviceHookServer``) and appends each
event it receives ("pause", "resume") to EVENTS_FILE. It lets the tests
observe, without timing, when the agent pauses an engine, whether requests
wait for each other, and that an engine is told to resume after a timeout.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

from podsnap.criu_plugin.hooks import DeviceHookServer
from podsnap.snapshot.registry import ContainerEntry, Registry


def main() -> None:
    container_id, events, release = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])

    def record(event: str) -> None:
        with open(events, "a") as f:
            f.write(event + "\n")

    def on_pause() -> str:
        record("pause")
        while not release.exists():
            time.sleep(0.02)
        return "cpu rank=0 snapshot=none"

    server = DeviceHookServer(on_pause, lambda meta: record("resume"))
    Registry().register(ContainerEntry.for_process(container_id, f"pod-{container_id}"))
    record("ready")
    try:
        threading.Event().wait()
    finally:
        server.close()


if __name__ == "__main__":
    main()
