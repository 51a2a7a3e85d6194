"""``podsnap snapshot ...``: create, list, inspect, verify and remove snapshots."""

from __future__ import annotations

import json
import time
from pathlib import Path

import click

from podsnap.errors import PodsnapError

STORE = click.option("--store", type=click.Path(file_okay=False, path_type=Path), required=True,
                     help="Snapshot store directory (shared storage, e.g. an RWX volume).")
JSON = click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")


def _cli():
    from podsnap import cli  # the group's helpers (console, progress bars, tables)

    return cli


@click.group()
def snapshot():
    """Snapshots of post-processed engine state in a store."""


@snapshot.command("create")
@STORE
@click.option("--model", "model_dir", type=click.Path(path_type=Path), default=None,
              help="Cold-start this HF checkpoint and snapshot it.")
@click.option("--tp", type=int, default=1, show_default=True, help="With --model: ranks to shard over.")
@click.option("--server", default=None, help="Snapshot a running `podsnap serve` at this URL instead.")
@click.option("--name", default=None, help="Snapshot name (default: snap-DATE-TIME-XXXX).")
@click.option("--quant", type=click.Choice(["none", "w8a8"]), default="none", show_default=True)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True)
@click.option("--with-kv", is_flag=True, help="Also store the KV-cache blocks.")
@click.option("--portable", is_flag=True,
              help="Store device-layout tensors in ND form; they are derived again on first use after restore.")
@click.option("--compile", "use_compile", is_flag=True,
              help="With --model: torch.compile the dense FFN blocks, warm up, and store the compile cache.")
@JSON
def create(store, model_dir, tp, server, name, quant, dtype, with_kv, portable, use_compile, as_json):
    """Snapshot a cold-started model (--model) or a running server (--server)."""
    cli = _cli()
    if (model_dir is None) == (server is None):
        raise click.UsageError("give exactly one of --model DIR or --server URL")
    if server:
        result = _post(server.rstrip("/") + "/admin/snapshot",
                       {"name": name, "with_kv": with_kv, "portable": portable})
        if Path(result.get("store", store)).resolve() != Path(store).resolve():
            cli.console.print(f"note: the server wrote to its own store {result['store']}", highlight=False)
    else:
        from podsnap.engine.config import ModelConfig
        from podsnap.engine.generate import cold
        from podsnap.engine.launch import run_on_ranks
        from podsnap.engine.sharding import check_world_size
        from podsnap.snapshot.capture import snapshot_on_rank

        check_world_size(ModelConfig.load(model_dir), tp)
        start = cold(model_dir, cli.engine_options(quant, dtype, use_compile))
        if tp == 1:
            with cli.byte_progress("cold start + snapshot", None, enabled=not as_json) as advance:
                result = snapshot_on_rank(0, 1, start, str(store), name, with_kv, portable, progress=advance)
        else:
            result = run_on_ranks(snapshot_on_rank, tp, start, str(store), name, with_kv, portable)
    if as_json:
        click.echo(json.dumps(result))
        return
    dedup = result["bytes_deduplicated"]
    click.echo(f"snapshot {result['snapshot']}: {result['tensors']} tensors, {result['bytes_total'] / 2**20:.1f} MiB, "
               f"wrote {result['bytes_written'] / 2**20:.1f} MiB"
               + (f" ({dedup / 2**20:.1f} MiB already in the store, not written again)" if dedup else ""))


def _post(url: str, body: dict) -> dict:
    from podsnap.client import request_json

    status, reply = request_json(url, body, timeout=3600)
    if status != 200:
        raise PodsnapError(f"{url} answered {status}: {reply.get('error', {}).get('message')}")
    return reply


def _open(store):
    from podsnap.snapshot.store import Store

    return Store(store, create=False)


def _summary(m) -> dict:
    return {"snapshot": m.snapshot_id, "created": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m.created)),
            "arch": m.fingerprint.arch, "tp": m.world_size, "quant": m.fingerprint.quant,
            "dtype": m.fingerprint.dtype, "with_kv": m.with_kv, "bytes": m.nbytes, "unique_bytes": m.unique_bytes()}


@snapshot.command("ls")
@STORE
@JSON
def ls(store, as_json):
    """List committed snapshots, oldest first."""
    rows = [_summary(m) for m in _open(store).manifests()]
    if as_json:
        click.echo(json.dumps(rows))
        return
    _cli().print_table(f"snapshots in {store}", ["snapshot", "created", "arch", "tp", "quant", "kv", "MiB"],
                       [[r["snapshot"], r["created"], r["arch"], r["tp"], r["quant"], "yes" if r["with_kv"] else "",
                         f"{r['bytes'] / 2**20:.1f}"] for r in rows])


@snapshot.command("inspect")
@STORE
@click.argument("snapshot_id")
@JSON
def inspect(store, snapshot_id, as_json):
    """Show a snapshot's fingerprint and tensors."""
    m = _open(store).load(snapshot_id)
    if as_json:
        click.echo(m.to_json())
        return
    cli = _cli()
    cli.print_table(f"snapshot {snapshot_id}", ["field", "value"],
                    [[k, v] for k, v in {**_summary(m), **m.fingerprint.__dict__}.items()])
    for rank in m.ranks:
        cli.print_table(f"rank {rank.rank}: {len(rank.tensors)} tensors", ["tensor", "role", "dtype", "shape",
                                                                           "layout", "interval", "blob"],
                        [[t.name, t.role, t.dtype, "x".join(map(str, t.shape)), t.layout + (f"→{t.derive}" if t.derive
                                                                                             else ""),
                          f"{t.interval['dim']}:{t.interval['start']}-{t.interval['stop']}" if t.interval else "",
                          t.blob[:12]] for t in rank.tensors])


@snapshot.command("verify")
@STORE
@click.argument("snapshot_id")
@JSON
def verify(store, snapshot_id, as_json):
    """Re-hash every blob of a snapshot; exit 1 and name each bad tensor and file if any is damaged."""
    s = _open(store)
    m = s.load(snapshot_id)
    problems, seen = [], {}
    with _cli().byte_progress("verifying", m.unique_bytes(), enabled=not as_json) as advance:
        for rank in m.ranks:
            for t in rank.tensors:
                if t.blob not in seen:
                    seen[t.blob] = s.verify_blob(t.blob, t.length)
                    advance(t.length)
                if seen[t.blob]:
                    problems.append(f"rank {rank.rank} tensor {t.name}: {seen[t.blob]}")
    if as_json:
        click.echo(json.dumps({"snapshot": snapshot_id, "ok": not problems, "blobs": len(seen), "problems": problems}))
    else:
        for p in problems:
            click.echo(p, err=True)
        click.echo(f"{snapshot_id}: {'OK' if not problems else 'DAMAGED'} ({len(seen)} blobs)")
    if problems:
        raise SystemExit(1)


@snapshot.command("rm")
@STORE
@click.argument("snapshot_id")
@JSON
def rm(store, snapshot_id, as_json):
    """Remove a snapshot and the blobs no other snapshot uses."""
    r = _open(store).remove(snapshot_id)
    out = {"snapshot": snapshot_id, "blobs_removed": r.blobs_removed, "bytes_freed": r.bytes_freed}
    click.echo(json.dumps(out) if as_json else f"removed {snapshot_id}: freed {r.bytes_freed / 2**20:.1f} MiB "
                                               f"in {r.blobs_removed} blobs")


@snapshot.command("gc")
@STORE
@JSON
def gc(store, as_json):
    """Delete blobs no snapshot references and leftovers of interrupted writes."""
    r = _open(store).gc()
    out = {"blobs_removed": r.blobs_removed, "bytes_freed": r.bytes_freed, "tmp_removed": r.tmp_removed}
    click.echo(json.dumps(out) if as_json else f"freed {r.bytes_freed / 2**20:.1f} MiB in {r.blobs_removed} blobs, "
                                               f"{r.tmp_removed} leftover file(s)")
