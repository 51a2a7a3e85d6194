"""``podsnap demo``: the main job, end to end on this machine.

1. make a random model (HF format),
2. cold-start a TP=2 server (read + post-process on each rank) and send requests,
3. snapshot the running server through its admin API (requests keep queueing),
4. stop it, warm-restore a new TP=2 server from the snapshot,
5. send the same requests: the tokens must be identical,
6. print cold start vs snapshot vs restore times and write a bar chart (PNG).
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from podsnap.client import ServerProcess, completion, request_json
from podsnap.engine.tiny import make_tiny
from podsnap.errors import PodsnapError

PROMPTS = [[1, 2, 3, 4, 5], [10, 20, 30], [7] * 12, [100, 200, 150, 250]]
MAX_TOKENS = 12


def serve_and_ask(args: list[str], say) -> tuple[ServerProcess, list[list[int]], dict]:
    server = ServerProcess(args)
    _, health = request_json(f"{server.url}/health")
    tokens = [completion(server.url, p, MAX_TOKENS) for p in PROMPTS]
    say(f"   ready in {server.ready_seconds:.2f} s at {server.url}; {len(PROMPTS)} requests answered")
    return server, tokens, health["startup"]


def run_demo(workdir: Path | None = None, preset: str = "small", quant: str = "w8a8",
             console: Console | None = None) -> dict:
    workdir = Path(workdir or "podsnap-demo").resolve()
    say = console.print if console else (lambda *a, **k: None)
    model_dir, store = workdir / f"llama-{preset}", workdir / "store"
    say(f"[bold]1.[/bold] making a random llama ({preset} preset) in {model_dir}")
    make_tiny("llama", model_dir, preset, seed=0)

    say(f"[bold]2.[/bold] cold start of a TP=2 server (quant={quant}): read checkpoint + post-process per rank")
    cold, cold_tokens, cold_startup = serve_and_ask(["--model", str(model_dir), "--tp", "2", "--quant", quant,
                                                     "--store", str(store)], say)
    try:
        say("[bold]3.[/bold] snapshot of the running server (POST /admin/snapshot)")
        status, snap = request_json(f"{cold.url}/admin/snapshot", {})
        if status != 200:
            raise PodsnapError(f"snapshot failed: {snap}")
        say(f"   {snap['snapshot']}: {snap['tensors']} tensors, {snap['bytes_total'] / 2**20:.1f} MiB, "
            f"serving paused {snap['paused_seconds']:.2f} s")
    finally:
        cold.stop()
    say("[bold]4.[/bold] server stopped; warm restore of a new TP=2 server from the snapshot")
    warm, warm_tokens, warm_startup = serve_and_ask(["--restore", f"{store}:{snap['snapshot']}",
                                                     "--model", str(model_dir), "--tp", "2"], say)
    warm.stop()
    identical = warm_tokens == cold_tokens
    verdict = "[green]identical[/green]" if identical else "[red]DIFFERENT[/red]"
    say(f"[bold]5.[/bold] tokens after restore are {verdict} to the cold start")
    result = {
        "model": str(model_dir), "snapshot": snap["snapshot"], "identical": identical,
        "tokens": cold_tokens, "restored_tokens": warm_tokens,
        "cold_start": {"ready_seconds": cold.ready_seconds, **cold_startup},
        "restore": {"ready_seconds": warm.ready_seconds, **warm_startup},
        "snapshot_stats": snap,
    }
    result["chart"] = str(write_chart(result, workdir / "demo.png"))
    if console:
        print_summary(result, console)
    if not identical:
        raise PodsnapError("restored tokens differ from the cold start")
    return result


def print_summary(r: dict, console: Console) -> None:
    c, w, s = r["cold_start"], r["restore"], r["snapshot_stats"]
    table = Table(title="cold start vs snapshot vs restore (seconds, rank 0)")
    for col in ("", "state ready (load + post-process)", "pod ready (process start to serving)"):
        table.add_column(col, justify="right")
    table.add_row("cold start", f"{c['load'] + c['postprocess']:.3f}", f"{c['ready_seconds']:.2f}")
    table.add_row("snapshot", f"{s['seconds']:.3f} (paused {s['paused_seconds']:.3f})", "")
    table.add_row("warm restore", f"{w['load'] + w['postprocess']:.3f}", f"{w['ready_seconds']:.2f}")
    console.print(table)
    ratio = (c["load"] + c["postprocess"]) / max(w["load"] + w["postprocess"], 1e-9)
    console.print(f"state ready: restore is {ratio:.1f}x faster than cold start; chart: {r['chart']}")


def write_chart(r: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c, w = r["cold_start"], r["restore"]
    labels = ["cold start", "snapshot", "warm restore"]
    state = [c["load"] + c["postprocess"], r["snapshot_stats"]["seconds"], w["load"] + w["postprocess"]]
    ready = [c["ready_seconds"], 0, w["ready_seconds"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], state, 0.4, label="engine state ready (load + post-process / write)")
    ax.bar([i + 0.2 for i in x], ready, 0.4, label="pod ready (process start to serving)")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("seconds")
    ax.set_title("podsnap demo: TP=2, " + Path(r["model"]).name)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
