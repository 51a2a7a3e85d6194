"""Process checkpoint of one engine with CRIU: podsnap's cooperative drop vs plain CRIU, side by side.

The same engine (TP=1, W8A8, one process, no HTTP server so that plain CRIU
can dump it too) is checkpointed twice in one run:

- podsnap: through the plugin; the engine pauses, makes sure its state is
  in the store, drops its tensors, and CRIU dumps what is left; after the
  restore the engine maps its tensors back from the store;
- plain:   CRIU without the plugin; the tensors are in the image.

Printed: image bytes, dump seconds, restore seconds (CRIU alone) and
restore-to-tokens seconds (CRIU restore until the restored engine has
generated), the ratios plain/podsnap, and whether the restored engine
generates the same tokens as before the checkpoint.

    sudo python bench/criu.py --preset small      # or 1g
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from common import DEFAULT_WORKDIR, bench_model

PROMPTS = [[1, 2, 3, 4], [9, 8, 7]]
MAX_TOKENS = 8


# --- the engine process ------------------------------------------------------------------------


def child(mode: str, model: Path, store: Path, work: Path) -> None:
    """Start the engine, write its tokens, then wait; after a restore, generate again when asked."""
    from podsnap.engine.generate import cold
    from podsnap.engine.llm_engine import EngineOptions
    from podsnap.engine.pod import Pod, PodConfig

    pod = Pod(PodConfig(0, 1, master="127.0.0.1:1", store=str(store)), cold(model, EngineOptions(quant="w8a8")))
    pod.engine = pod.start(0, 1)
    pod.join("127.0.0.1", 1, 0)
    hooks = None
    if mode == "podsnap":
        from podsnap.criu_plugin.suspend import ProcessCheckpointHooks

        hooks = ProcessCheckpointHooks(pod, str(store), verify="none")
    (work / "before.json").write_text(json.dumps(pod.engine.generate(PROMPTS, MAX_TOKENS)))
    go, after = work / "go", work / "after.json"
    while True:
        if go.exists() and not (hooks and hooks.paused.is_set()):
            after.write_text(json.dumps(pod.engine.generate(PROMPTS, MAX_TOKENS)))
            go.unlink()
        time.sleep(0.005)


# --- the benchmark -------------------------------------------------------------------------------


def wait_for(path: Path, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {path}")
        time.sleep(0.005)


def reap(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


def one_run(mode: str, model: Path, root: Path) -> dict:
    from podsnap.criu_plugin import driver

    work, store, images = root / mode, root / "store", root / mode / "images"
    work.mkdir(parents=True)
    with open(work / "engine.log", "w") as log:
        proc = subprocess.Popen([sys.executable, __file__, "--child", mode, "--model", str(model), "--store",
                                 str(store), "--workdir", str(work)], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    pid = proc.pid
    try:
        wait_for(work / "before.json")
        dumped = driver.dump(pid, images, use_plugin=mode == "podsnap")
        proc.wait(30)
        t = time.perf_counter()
        pid, restore_s = driver.restore(images, use_plugin=mode == "podsnap")
        (work / "go").touch()
        wait_for(work / "after.json")
        to_tokens = time.perf_counter() - t
        same = json.loads((work / "after.json").read_text()) == json.loads((work / "before.json").read_text())
        return {"image_bytes": dumped.image_bytes, "dump_s": dumped.seconds, "restore_s": restore_s,
                "restore_to_tokens_s": to_tokens, "same_tokens": same}
    finally:
        reap(pid)
        if proc.poll() is None:
            reap(proc.pid)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=["small", "1g"], default="small")
    ap.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR)
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    ap.add_argument("--child", choices=["podsnap", "plain"], help=argparse.SUPPRESS)
    ap.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--store", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.model, args.store, args.workdir)

    model = bench_model("llama", args.preset, args.workdir)
    root = args.workdir / f"criu-{os.getpid()}"
    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: restored engines are ours to reap
    try:
        results = {mode: one_run(mode, model, root) for mode in ("podsnap", "plain")}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ours, plain = results["podsnap"], results["plain"]
    ratios = {k: plain[k] / ours[k] for k in ("image_bytes", "dump_s", "restore_s", "restore_to_tokens_s")}
    if args.json:
        print(json.dumps({"preset": args.preset, **results, "plain_over_podsnap": ratios}))
        return
    print(f"\nCRIU checkpoint of one engine process (llama {args.preset}, W8A8, TP=1)")
    print(f"{'':22}{'podsnap':>12}{'plain CRIU':>14}{'plain/podsnap':>16}")
    print(f"{'image':22}{ours['image_bytes'] / 2**20:>10.1f}MB{plain['image_bytes'] / 2**20:>12.1f}MB"
          f"{ratios['image_bytes']:>15.1f}x")
    for key, label in (("dump_s", "dump"), ("restore_s", "restore (CRIU)"), ("restore_to_tokens_s",
                                                                          "restore -> tokens")):
        print(f"{label:22}{ours[key]:>11.2f}s{plain[key]:>13.2f}s{ratios[key]:>15.2f}x")
    print(f"{'same tokens after':22}{str(ours['same_tokens']):>12}{str(plain['same_tokens']):>14}")


if __name__ == "__main__":
    main()
