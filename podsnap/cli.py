"""The ``podsnap`` command line.

Every command that scripts read has ``--json``. Errors caused by input are
printed as one ``error: ...`` line (no traceback) with exit status 2.
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import click
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TransferSpeedColumn,
)
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


@contextmanager
def byte_progress(description: str, total: int | None, enabled: bool = True):
    """A rich bytes/throughput bar; yields a thread-safe ``advance(nbytes)`` callback."""
    columns = [TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
               TransferSpeedColumn(), TimeElapsedColumn()]
    with Progress(*columns, console=console, disable=not enabled, transient=False) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n: bar.advance(task, n)


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
                  console=console, disable=as_json or preset == "tiny") as bar:
        task = bar.add_task(f"making {arch}/{preset}", total=total)
        cfg = make_tiny(arch, out, preset, seed, shards, progress=lambda _: bar.advance(task))
    files = sorted(p.name for p in out.iterdir())
    size = sum((out / f).stat().st_size for f in files)
    if as_json:
        click.echo(json.dumps({"out": str(out), "arch": arch, "preset": preset, "seed": seed,
                               "files": files, "bytes": size, "config": cfg.to_hf()}))
    else:
        click.echo(f"wrote {arch}/{preset} (seed {seed}) to {out}: {len(files)} files, {size / 2**20:.1f} MiB")


def engine_options(quant: str | None, dtype: str | None, use_compile: bool = False):
    from podsnap.engine.llm_engine import EngineOptions

    return EngineOptions(quant=quant or "none", dtype=dtype or "float32", compile=use_compile)


def start_options(f):
    """Options shared by `generate` and `serve`: where the engine's state comes from."""
    opts = [
        click.option("--model", "model_dir", type=click.Path(path_type=Path), default=None,
                     help="HF checkpoint directory. With --restore: the model the snapshot must match "
                          "(checked by tensor values)."),
        click.option("--restore", default=None, metavar="STORE:SNAPSHOT",
                     help="Warm start from a snapshot instead of reading and post-processing the checkpoint."),
        click.option("--quant", type=click.Choice(["none", "w8a8"]), default=None,
                     help="Post-processing: w8a8 = int8 weights (FRACTAL_NZ), per-token int8 activations. "
                          "[default: none; with --restore: the snapshot's]"),
        click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default=None,
                     help="Compute dtype (float32 is the fast one on CPUs without native bf16). "
                          "[default: float32; with --restore: the snapshot's]"),
        click.option("--verify", type=click.Choice(["full", "sample", "none"]), default="full", show_default=True,
                     help="With --restore: hash verification of the restored tensors."),
        click.option("--load-mode", type=click.Choice(["read", "mmap"]), default="read", show_default=True,
                     help="With --restore: parallel range reads, or zero-copy private mmap."),
        click.option("--force", is_flag=True, help="With --restore: restore even if the fingerprint differs."),
        click.option("--compile", "use_compile", is_flag=True,
                     help="torch.compile the dense FFN blocks (a restore reuses the snapshot's compile cache)."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def engine_factory(model_dir, restore, quant, dtype, verify, load_mode, force, use_compile=False, progress=None):
    """A picklable ``(rank, world) -> LLMEngine``: a cold start, or a warm start from --restore."""
    from podsnap.engine.generate import cold

    if restore is None:
        if model_dir is None:
            raise click.UsageError("give --model DIR (cold start) or --restore STORE:SNAPSHOT (warm start)")
        return cold(model_dir, engine_options(quant, dtype, use_compile))
    from podsnap.engine.llm_engine import EngineOptions
    from podsnap.restore.warm import parse_restore_ref, warm_start

    store, snap = parse_restore_ref(restore)
    options = None
    if quant or dtype:  # asked for explicitly: the snapshot must match
        manifest_opts = _snapshot_options(store, snap)
        options = EngineOptions(**{**manifest_opts, **({"quant": quant} if quant else {}),
                                   **({"dtype": dtype} if dtype else {})})
    return partial(warm_start, store, snap, model_dir=model_dir, options=options, verify=verify,
                   load_mode=load_mode, force=force, progress=progress)


def _snapshot_options(store: str, snap: str) -> dict:
    from podsnap.snapshot.store import Store

    return Store(store, create=False).load(snap).options


@main.command()
@start_options
@click.option("--prompt-ids", required=True, help="Prompt as comma-separated token ids, e.g. 1,2,3.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=16, show_default=True,
              help="Tokens to generate (greedy).")
@click.option("--tp", type=int, default=1, show_default=True,
              help="Tensor-parallel ranks, one process each; any number up to the model's attention heads.")
@click.option("--json", "as_json", is_flag=True, help="Print {tokens, timings} as one JSON object.")
def generate(model_dir, restore, quant, dtype, verify, load_mode, force, use_compile, prompt_ids, max_tokens, tp,
             as_json):
    """Start the engine (cold, or warm with --restore) and generate greedily."""
    from podsnap.engine.config import ModelConfig
    from podsnap.engine.generate import generate as run_generate
    from podsnap.engine.sharding import check_world_size

    prompt = parse_token_ids(prompt_ids)
    if model_dir is not None:
        check_world_size(ModelConfig.load(model_dir), tp)
    show = restore is not None and tp == 1 and not as_json
    with byte_progress("restoring", None, enabled=show) as advance:
        start = engine_factory(model_dir, restore, quant, dtype, verify, load_mode, force, use_compile,
                               progress=advance if show else None)
        result = run_generate(start, [prompt], max_tokens, tp=tp)
    tokens, timings = result.tokens[0], result.timings
    if as_json:
        click.echo(json.dumps({"tokens": tokens, "timings": timings, "postprocess_calls": result.postprocess_calls,
                               "compile_cache": result.compile_cache}))
        return
    click.echo(" ".join(map(str, tokens)))
    console.print(", ".join(f"{k} {v * 1000:.1f} ms" for k, v in timings.items() if k != "decode_tokens_per_s"),
                  highlight=False)


@main.command()
@start_options
@click.option("--tp", type=int, default=None,
              help="Launch TP ranks on this machine, one process each (rank 0 serves HTTP).")
@click.option("--rank", type=int, default=None, help="Pod-per-rank form: run only this rank.")
@click.option("--world", type=int, default=None, help="Pod-per-rank form: number of ranks in the group.")
@click.option("--master", default=None, help="Pod-per-rank form: HOST:PORT of rank 0's rendezvous.")
@click.option("--host", default="127.0.0.1", show_default=True, help="HTTP address of rank 0.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True,
              help="HTTP port of rank 0 (0 picks a free one).")
@click.option("--connect-timeout", type=click.FloatRange(min=0.1), default=60.0, show_default=True,
              help="Seconds a rank waits for the whole group to form before failing.")
@click.option("--store", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Snapshot store for POST /admin/snapshot (each rank writes its own tensors there).")
@click.option("--backend", type=click.Choice(["gloo", "nccl", "hccl"]), default="gloo", show_default=True,
              help="torch.distributed backend of the TP group (gloo on CPU; nccl/hccl on GPUs/NPUs, untested here).")
@click.option("--restore-metadata", "metadata", type=click.Path(dir_okay=False), default=None,
              help="Pod-per-rank form: JSON written by the controller on restore (generation, master_addr, "
                   "port_base, rank_map); read at start and polled when the master moves.")
@click.option("--container-id", default=None,
              help="Pod-per-rank form: register this rank process with the snapshot agent (standalone mode) as "
                   "this container, in $PODSNAP_AGENT_REGISTRY (default /run/podsnap/agent/registry).")
@click.option("--pod-name", default=None, help="With --container-id: the pod's name [default: the container id].")
@click.option("--pod-namespace", default="default", show_default=True, help="With --container-id: the namespace.")
def serve(model_dir, restore, quant, dtype, verify, load_mode, force, use_compile, tp, rank, world, master, host,
          port, connect_timeout, store, backend, metadata, container_id, pod_name, pod_namespace):
    """Serve over HTTP with tensor parallelism (cold start, or warm with --restore).

    \b
    Local:        podsnap serve --model DIR --tp 2 --port 8000 [--store S]
    Pod per rank: podsnap serve --model DIR --rank R --world N --master HOST:PORT
    Warm start:   podsnap serve --restore S:SNAPSHOT --tp 2
    API: POST /v1/completions {"prompt": [ids], "max_tokens": N, "temperature": 0},
         GET /health, GET /metrics (Prometheus), POST /admin/snapshot (with --store),
         POST /admin/rebuild. The admin routes answer loopback callers only, unless
         PODSNAP_ADMIN_TOKEN is set: then callers must send "Authorization: Bearer TOKEN".
    """
    from podsnap.engine.config import ModelConfig
    from podsnap.engine.launch import launch_local_pods
    from podsnap.engine.pod import PodConfig, metadata_path_ok, serve_rank
    from podsnap.engine.sharding import check_world_size

    pod_form = (rank, world, master)
    if tp is not None and any(v is not None for v in pod_form):
        raise click.UsageError("give either --tp N (local) or --rank/--world/--master (pod per rank), not both")
    if tp is None and (rank is None or world is None):
        raise click.UsageError("give --tp N, or --rank and --world (with --master, MASTER_ADDR/MASTER_PORT or "
                               "--restore-metadata)")
    ranks = tp if tp is not None else world
    if model_dir is not None:
        check_world_size(ModelConfig.load(model_dir), ranks)
    start = engine_factory(model_dir, restore, quant, dtype, verify, load_mode, force, use_compile)
    if tp is None and not 0 <= rank < world:
        raise click.BadParameter(f"--rank {rank} must be in 0..{world - 1} for --world {world}")
    if tp is not None:
        if container_id:
            raise click.UsageError("--container-id registers one rank process: use it with --rank/--world")
        if tp < 1:
            raise click.BadParameter(f"--tp {tp}: the number of ranks must be at least 1")
        args = [*(["--model", str(model_dir)] if model_dir else []), *(["--restore", restore] if restore else []),
                *(["--quant", quant] if quant else []), *(["--dtype", dtype] if dtype else []),
                "--verify", verify, "--load-mode", load_mode, *(["--force"] if force else []),
                *(["--compile"] if use_compile else []),
                *(["--store", str(store)] if store else []), "--backend", backend,
                "--host", host, "--port", str(port), "--connect-timeout", str(connect_timeout)]
        procs = launch_local_pods(tp, args)
        sys.exit(max((p.returncode or 0) for p in procs))
    cfg = PodConfig(rank, world, master, metadata_path_ok(metadata), host, port, connect_timeout,
                    str(store) if store else None, deferred_join=restore is not None,
                    admin_token=os.environ.get("PODSNAP_ADMIN_TOKEN") or None, backend=backend)
    with registered(container_id, pod_name, pod_namespace, store):
        serve_rank(cfg, start)


@contextmanager
def registered(container_id: str | None, pod_name: str | None, namespace: str, store: Path | None):
    """Register this process with the agent's registry (standalone mode) while it serves."""
    if container_id is None:
        yield
        return
    from podsnap.snapshot.registry import ContainerEntry, Registry

    registry = Registry()
    entry = ContainerEntry.for_process(container_id, pod_name or container_id, namespace,
                                       store=str(Path(store).resolve()) if store else None)
    registry.register(entry)
    try:
        yield
    finally:
        registry.unregister(container_id, pid=os.getpid())


@main.command()
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=Path("podsnap-demo"),
              show_default=True, help="Where the demo model, store and chart go.")
@click.option("--preset", type=click.Choice(["tiny", "small", "1g"]), default="small", show_default=True,
              help="Model size (1g shows the cold-start cost a restore skips).")
@click.option("--quant", type=click.Choice(["none", "w8a8"]), default="w8a8", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the demo's figures as one JSON object.")
def demo(workdir, preset, quant, as_json):
    """The main job: cold-start a TP=2 server, snapshot it, restore it, compare tokens and times."""
    from podsnap.demo import run_demo

    result = run_demo(workdir, preset, quant, console=None if as_json else console)
    if as_json:
        click.echo(json.dumps(result))


def print_table(title: str, columns: list[str], rows: list[list]) -> None:
    table = Table(title=title)
    for c in columns:
        table.add_column(c)
    for r in rows:
        table.add_row(*map(str, r))
    console.print(table)


from podsnap.cli_agent import agent  # noqa: E402
from podsnap.cli_criu import checkpoint, doctor, restore_process  # noqa: E402
from podsnap.cli_snapshot import snapshot  # noqa: E402  (registers `podsnap snapshot ...`)

main.add_command(snapshot)
main.add_command(checkpoint)
main.add_command(restore_process)
main.add_command(doctor)
main.add_command(agent)

if __name__ == "__main__":
    main()
