"""``podsnap checkpoint``, ``podsnap restore-process``, ``podsnap doctor``: process-level C/R with CRIU."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import click

from podsnap.errors import PodsnapError

from .cli_snapshot import JSON, STORE

CHECKPOINT_RECORD = "checkpoint.json"


@dataclass
class ProcessCheckpoint:
    """What ``podsnap checkpoint`` wrote: one CRIU image directory per process, and the engine
    snapshot each engine put in the store when it paused."""
    name: str
    created: float
    processes: list[dict] = field(default_factory=list)  # DumpResult.to_dict() of each process

    def write(self, path: Path) -> None:
        from podsnap.snapshot.store import write_private

        write_private(path / CHECKPOINT_RECORD, json.dumps(asdict(self), indent=1).encode())

    @classmethod
    def read(cls, path: Path) -> ProcessCheckpoint:
        try:
            return cls(**json.loads((path / CHECKPOINT_RECORD).read_text()))
        except (OSError, ValueError, TypeError) as e:
            raise PodsnapError(f"no process checkpoint at {path} ({e}); list them with `ls {path.parent}`") from None


def _cli():
    from podsnap import cli

    return cli


@click.command()
@click.option("--pid", "pids", type=int, multiple=True, required=True,
              help="Engine process to checkpoint; repeat for every rank of a group (they pause together).")
@STORE
@click.option("--name", default=None, help="Checkpoint name (default: proc-DATE-TIME-XXXX).")
@click.option("--leave-running", is_flag=True, help="Keep the processes running after the dump.")
@click.option("--no-plugin", is_flag=True,
              help="Plain CRIU: no podsnap plugin, so the tensors go into the image (for comparison).")
@click.option("--timeout", type=float, default=300, show_default=True, help="Seconds each dump may take.")
@JSON
def checkpoint(pids, store, name, leave_running, no_plugin, timeout, as_json):
    """Checkpoint engine processes with CRIU through podsnap's plugin.

    Each engine pauses at a step boundary, makes sure its state is in the
    store, drops its tensors and process groups, and is dumped; its image
    holds no tensor. Images go to STORE/processes/NAME/pid-PID. Without
    --leave-running the processes end after the dump. If CRIU fails, the
    engines resume and the error quotes CRIU's log.
    """
    from podsnap.criu_plugin import driver
    from podsnap.snapshot.store import Store, new_snapshot_id

    cli = _cli()
    s = Store(store)
    name = name or new_snapshot_id().replace("snap-", "proc-", 1)
    top = s.process_dir(name)
    if (top / CHECKPOINT_RECORD).exists():
        raise PodsnapError(f"process checkpoint {name!r} already exists in {store}; choose another --name")
    results = driver.dump_group(list(pids), lambda pid: s.process_dir(name, pid), leave_running=leave_running,
                                use_plugin=not no_plugin, timeout_s=timeout)
    record = ProcessCheckpoint(name, time.time(), [r.to_dict() for r in results])
    record.write(top)
    if as_json:
        click.echo(json.dumps(asdict(record)))
        return
    cli.print_table(f"process checkpoint {name}", ["pid", "rank", "engine snapshot", "image", "dump s"],
                    [[r.pid, r.engine.get("rank", "-"), r.engine.get("snapshot", "-"),
                      f"{r.image_bytes / 2**20:.1f} MiB", f"{r.seconds:.2f}"] for r in results])


@click.command("restore-process")
@STORE
@click.option("--checkpoint", "name", required=True, help="Process checkpoint name (from `podsnap checkpoint`).")
@click.option("--rank", type=int, default=None, help="Which engine of the checkpoint (default: the only one).")
@click.option("--netns", default=None, help="Network namespace to restore into (a name from `ip netns list`).")
@click.option("--restore-metadata", "metadata", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="JSON with the group's new master, port base and generation (comm_rebuild format).")
@click.option("--timeout", type=float, default=300, show_default=True, help="Seconds CRIU may take.")
@JSON
def restore_process(store, name, rank, netns, metadata, timeout, as_json):
    """Restore one engine process of a checkpoint, detached, in a pod's network namespace.

    The engine resumes once running: it maps its tensors back from the
    store and rebuilds its process group for the new address (from
    --restore-metadata, or the next generation of the same master).
    """
    from podsnap.criu_plugin import driver
    from podsnap.snapshot.store import Store

    s = Store(store, create=False)
    record = ProcessCheckpoint.read(s.process_dir(name))
    proc = pick_process(record, rank)
    if metadata is not None and not metadata.is_file():
        raise click.BadParameter(f"{metadata} does not exist", param_hint="--restore-metadata")
    pid, seconds = driver.restore(s.process_dir(name, proc["pid"]), netns=netns, metadata=metadata,
                                  timeout_s=timeout)
    out = {"checkpoint": name, "pid": pid, "rank": proc["engine"].get("rank"), "netns": netns,
           "restore_seconds": round(seconds, 6)}
    if as_json:
        click.echo(json.dumps(out))
    else:
        _cli().console.print(f"restored pid {pid} (rank {out['rank']}) into netns {netns or '(this one)'} "
                             f"in {seconds:.2f} s", highlight=False)


def pick_process(record: ProcessCheckpoint, rank: int | None) -> dict:
    ranks = {int(p["engine"]["rank"]): p for p in record.processes if "rank" in p["engine"]}
    if rank is None:
        if len(record.processes) != 1:
            raise click.UsageError(f"checkpoint {record.name!r} holds {len(record.processes)} processes; "
                                   f"give --rank (one of {sorted(ranks)})")
        return record.processes[0]
    if rank not in ranks:
        raise click.BadParameter(f"checkpoint {record.name!r} has no rank {rank}; it has {sorted(ranks)}",
                                 param_hint="--rank")
    return ranks[rank]


@click.command()
@JSON
def doctor(as_json):
    """Report what works here for process checkpoints, and how to fix what does not."""
    from podsnap.doctor import run_checks

    checks = run_checks()
    if as_json:
        click.echo(json.dumps([asdict(c) for c in checks]))
    else:
        _cli().print_table("podsnap doctor", ["check", "ok", "detail", "fix"],
                           [[c.name, "yes" if c.ok else "NO", c.detail, c.fix or ""] for c in checks])
    if not all(c.ok for c in checks):
        raise SystemExit(1)
