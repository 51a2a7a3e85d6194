"""The ``podsnap`` command line.

Every command that scripts read has ``--json``. Errors caused by input are
printed as one ``error: ...`` line (no traceback) with exit status 2.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from podsnap import __version__
from podsnap.errors import PodsnapError

console = Console(stderr=True)


def parse_token_ids(value: str) -> list[int]:
    """``"1,2,3"`` -> ``[1, 2, 3]``; anything else is a usage error naming the bad item."""
    items = [s.strip() for s in value.split(",")]
    try:
        ids = [int(s) for s in items]
    except ValueError:
        bad = next(s for s in items if not s.lstrip("-").isdigit())
        raise click.BadParameter(f"{bad!r} is not an integer; give comma-separated token ids like 1,2,3") from None
    if any(i < 0 for i in ids):
        raise click.BadParameter(f"token ids must be >= 0, got {min(ids)}")
    return ids


class PodsnapGroup(click.Group):
    """Turns PodsnapError into a one-line message and exit status 2."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except PodsnapError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)


@click.group(cls=PodsnapGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="podsnap")
def main():
    """podsnap: checkpoint/restore for LLM inference pods.

    Freezes the post-processed engine state of a serving pod into shared
    storage and restores it in seconds. Start with `podsnap demo`.
    """


@main.group()
def model():
    """Make and inspect model checkpoints."""


@model.command("make-tiny")
@click.option("--arch", type=click.Choice(["llama", "qwen3", "qwen3-moe"]), required=True,
              help="Architecture; config.json uses that architecture's HF field names.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Directory to write config.json and the safetensors into.")
@click.option("--preset", type=click.Choice(["tiny", "small", "1g"]), default="tiny", show_default=True,
              help="tiny: runs in well under a second; small: for TP tests; 1g: ~1 GiB bf16 for benchmarks.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the deterministic random init.")
@click.option("--shards", type=click.IntRange(min=1), default=1, show_default=True,
              help="Number of safetensors files (an index file is written when > 1).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object.")
def make_tiny_cmd(arch, out, preset, seed, shards, as_json):
    """Write a random HF-format checkpoint (deterministic for a given seed)."""
    from podsnap.engine.tiny import hf_tensor_shapes, make_tiny, preset_config

    total = len(hf_tensor_shapes(preset_config(arch, preset)))
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, disable=as_json or total < 200) as bar:
        task = bar.add_task(f"making {arch}/{preset}", total=total)
        cfg = make_tiny(arch, out, preset, seed, shards, progress=lambda _: bar.advance(task))
    files = sorted(p.name for p in out.iterdir())
    size = sum((out / f).stat().st_size for f in files)
    if as_json:
        click.echo(json.dumps({"out": str(out), "arch": arch, "preset": preset, "seed": seed,
                               "files": files, "bytes": size, "config": cfg.to_hf()}))
    else:
        click.echo(f"wrote {arch}/{preset} (seed {seed}) to {out}: {len(files)} files, {size / 2**20:.1f} MiB")


def engine_options(quant: str, dtype: str):
    from podsnap.engine.llm_engine import EngineOptions

    return EngineOptions(quant=quant, dtype=dtype)


@main.command()
@click.option("--model", "model_dir", type=click.Path(path_type=Path), required=True,
              help="HF checkpoint directory (config.json + *.safetensors).")
@click.option("--prompt-ids", required=True, help="Prompt as comma-separated token ids, e.g. 1,2,3.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=16, show_default=True,
              help="Tokens to generate (greedy).")
@click.option("--quant", type=click.Choice(["none", "w8a8"]), default="none", show_default=True,
              help="Post-processing: w8a8 = int8 weights (FRACTAL_NZ) with per-token int8 activations.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True,
              help="Compute dtype (float32 is the fast one on CPUs without native bf16).")
@click.option("--json", "as_json", is_flag=True, help="Print {tokens, timings} as one JSON object.")
def generate(model_dir, prompt_ids, max_tokens, quant, dtype, as_json):
    """Cold-start the engine on MODEL and generate greedily."""
    from podsnap.engine.llm_engine import LLMEngine

    prompt = parse_token_ids(prompt_ids)
    engine = LLMEngine.cold_start(model_dir, engine_options(quant, dtype))
    tokens = engine.generate([prompt], max_tokens)[0]
    timings = engine.timings.to_dict()
    if as_json:
        click.echo(json.dumps({"tokens": tokens, "timings": timings}))
        return
    click.echo(" ".join(map(str, tokens)))
    console.print(", ".join(f"{k} {v * 1000:.1f} ms" for k, v in timings.items()), highlight=False)


@main.command()
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where to write the demo model (default: a temporary directory).")
@click.option("--json", "as_json", is_flag=True, help="Print the demo's figures as one JSON object.")
def demo(workdir, as_json):
    """Make a small model, cold-start it and generate: the main job, end to end."""
    from podsnap.demo import run_demo

    result = run_demo(workdir, console=None if as_json else console)
    if as_json:
        click.echo(json.dumps(result))


def print_table(title: str, columns: list[str], rows: list[list]) -> None:
    table = Table(title=title)
    for c in columns:
        table.add_column(c)
    for r in rows:
        table.add_row(*map(str, r))
    console.print(table)


if __name__ == "__main__":
    main()
