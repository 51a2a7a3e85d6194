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
@click.option("--tp", type=int, default=1, show_default=True,
              help="Tensor-parallel ranks, one process each; any number up to the model's attention heads.")
@click.option("--json", "as_json", is_flag=True, help="Print {tokens, timings} as one JSON object.")
def generate(model_dir, prompt_ids, max_tokens, quant, dtype, tp, as_json):
    """Cold-start the engine on MODEL and generate greedily."""
    from podsnap.engine.config import ModelConfig
    from podsnap.engine.generate import generate as run_generate
    from podsnap.engine.sharding import check_world_size

    prompt = parse_token_ids(prompt_ids)
    check_world_size(ModelConfig.load(model_dir), tp)
    result = run_generate(model_dir, [prompt], max_tokens, engine_options(quant, dtype), tp)
    tokens, timings = result.tokens[0], result.timings
    if as_json:
        click.echo(json.dumps({"tokens": tokens, "timings": timings}))
        return
    click.echo(" ".join(map(str, tokens)))
    console.print(", ".join(f"{k} {v * 1000:.1f} ms" for k, v in timings.items()), highlight=False)


@main.command()
@click.option("--model", "model_dir", type=click.Path(path_type=Path), required=True,
              help="HF checkpoint directory.")
@click.option("--tp", type=int, default=None,
              help="Launch TP ranks on this machine, one process each (rank 0 serves HTTP).")
@click.option("--rank", type=int, default=None, help="Pod-per-rank form: run only this rank.")
@click.option("--world", type=int, default=None, help="Pod-per-rank form: number of ranks in the group.")
@click.option("--master", default=None, help="Pod-per-rank form: HOST:PORT of rank 0's rendezvous.")
@click.option("--quant", type=click.Choice(["none", "w8a8"]), default="none", show_default=True)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True)
@click.option("--host", default="127.0.0.1", show_default=True, help="HTTP address of rank 0.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True,
              help="HTTP port of rank 0 (0 picks a free one).")
@click.option("--connect-timeout", type=click.FloatRange(min=0.1), default=60.0, show_default=True,
              help="Seconds a rank waits for the whole group to form before failing.")
def serve(model_dir, tp, rank, world, master, quant, dtype, host, port, connect_timeout):
    """Serve MODEL over HTTP with tensor parallelism.

    \b
    Local:        podsnap serve --model DIR --tp 2 --port 8000
    Pod per rank: podsnap serve --model DIR --rank R --world N --master HOST:PORT
    API: POST /v1/completions {"prompt": [ids], "max_tokens": N, "temperature": 0},
         GET /health, GET /metrics (Prometheus).
    """
    from podsnap.engine.config import ModelConfig
    from podsnap.engine.launch import launch_local_pods
    from podsnap.engine.server import serve_rank
    from podsnap.engine.sharding import check_world_size

    pod_form = (rank, world, master)
    if tp is not None and any(v is not None for v in pod_form):
        raise click.UsageError("give either --tp N (local) or --rank/--world/--master (pod per rank), not both")
    if tp is None and any(v is None for v in pod_form):
        raise click.UsageError("give --tp N, or all of --rank, --world and --master")
    cfg = ModelConfig.load(model_dir)
    check_world_size(cfg, tp if tp is not None else world)
    if tp is None and not 0 <= rank < world:
        raise click.BadParameter(f"--rank {rank} must be in 0..{world - 1} for --world {world}")
    if tp is not None:
        args = ["--model", str(model_dir), "--quant", quant, "--dtype", dtype, "--host", host, "--port", str(port),
                "--connect-timeout", str(connect_timeout)]
        procs = launch_local_pods(tp, args)
        sys.exit(max((p.returncode or 0) for p in procs))
    serve_rank(rank, world, master, str(model_dir), engine_options(quant, dtype), host, port, connect_timeout)


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
