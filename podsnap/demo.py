"""``podsnap demo``: the main job, end to end on this machine.

Makes a small random Llama, cold-starts the engine (read + post-process),
generates for a few prompts and prints where the cold-start time goes: the
part a podsnap restore skips. Later steps (snapshot, restore, elastic TP)
join this demo as they land.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from podsnap.engine.llm_engine import EngineOptions, LLMEngine
from podsnap.engine.tiny import make_tiny

PROMPTS = [[1, 2, 3, 4, 5], [10, 20, 30], [7] * 12]
COMING = [
    "snapshot: freeze the post-processed state into a deduplicated store",
    "restore: map it back and skip read + post-process",
    "elastic TP: keep serving on any number of ranks",
]


def run_demo(workdir: Path | None = None, console: Console | None = None) -> dict:
    with tempfile.TemporaryDirectory(prefix="podsnap-demo-") as tmp:
        model_dir = Path(workdir or tmp) / "llama-small"
        say = console.print if console else (lambda *a, **k: None)
        say(f"[bold]1.[/bold] making a random llama (small preset) in {model_dir}")
        make_tiny("llama", model_dir, "small", seed=0)
        results = {}
        for quant in ("none", "w8a8"):
            say(f"[bold]2.[/bold] cold start, quant={quant}: read checkpoint, post-process, generate")
            engine = LLMEngine.cold_start(model_dir, EngineOptions(quant=quant))
            tokens = engine.generate(PROMPTS, max_tokens=8)
            results[quant] = {"tokens": tokens, "timings": engine.timings.to_dict(),
                              "state_bytes": engine.state().nbytes}
        if console:
            table = Table(title="cold start (ms)")
            for col in ("quant", "load", "postprocess", "first token", "total", "state MiB"):
                table.add_column(col, justify="right")
            for quant, r in results.items():
                t = r["timings"]
                table.add_row(quant, *(f"{t[k] * 1000:.1f}" for k in ("load", "postprocess", "first_token", "total")),
                              f"{r['state_bytes'] / 2**20:.2f}")
            console.print(table)
            for quant, r in results.items():
                say(f"tokens ({quant}): {r['tokens']}")
            say("[bold]what comes next:[/bold]")
            for line in COMING:
                say(f"  - {line}")
        return results
