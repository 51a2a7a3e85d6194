"""One rank of a serving group (one pod): join, start, serve or follow, and rebuild.

Start-up: a rank finds its own and the master's address (metadata file,
environment/``--master``, interfaces). A warm-restoring rank restores its
state alone first and joins the group afterwards (deferred join), so the
ranks already running do not wait for its restore; a cold-starting rank joins
first, because W8A8 post-processing reduces scales over the group.

Rebuild (generation g -> g+1), when a rank dies or ``POST /admin/rebuild``
asks for it:

- rank 0 preempts the running sequences (they are recomputed later: greedy
  decoding gives the same tokens), tears the old groups down (bounded), hosts
  generation g+1's rendezvous, keeps queueing requests until every rank is
  ready, then forms the new groups and resumes;
- a surviving follower tears down and rejoins: at the generation and master
  named by a newer restore-metadata file (the master moved), else at g+1 of
  the master it knows;
- a replacement rank is started with the new metadata and simply joins.
"""

from __future__ import annotations

import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from podsnap.comm_rebuild import groups
from podsnap.comm_rebuild.discovery import Addresses, discover, from_metadata_file
from podsnap.errors import PodsnapError

from .generate import warm_up
from .llm_engine import LLMEngine
from .server import BadRequest, EngineServer, admin_snapshot, bad_request, parse_json_object


class RebuildRequested(Exception):
    """Raised in a follower by the "rebuild" control op: leave ``follow()`` and rejoin."""

    def __init__(self, msg: dict):
        super().__init__(f"rebuild to generation {msg.get('generation')}")
        self.msg = msg


def log(msg: str) -> None:
    print(f"podsnap: {msg}", file=sys.stderr, flush=True)


@dataclass
class PodConfig:
    rank: int
    world: int
    master: str | None = None  # HOST:PORT of generation 0 (or from the environment / metadata)
    metadata: str | None = None  # restore-metadata file
    host: str = "127.0.0.1"  # rank 0's HTTP address
    port: int = 8000
    connect_timeout_s: float = 60.0
    store: str | None = None  # snapshot store for POST /admin/snapshot
    deferred_join: bool = False  # restore alone first, join afterwards
    admin_token: str | None = None  # required from non-loopback callers of /admin/*
    backend: str = "gloo"
    process_hooks: bool = True  # with a store: listen for the CRIU plugin (process checkpoints)


class Pod:
    def __init__(self, cfg: PodConfig, start):
        self.cfg = cfg
        self.start = start  # (rank, world) -> LLMEngine
        self.addrs: Addresses = discover(cfg.rank, cfg.metadata, cfg.master)
        self.engine: LLMEngine | None = None
        self.server: EngineServer | None = None
        self.last_join: dict = {}
        self.checkpoint_hooks = None  # criu_plugin.suspend.ProcessCheckpointHooks, with a store

    # --- start-up ---------------------------------------------------------------

    def run(self) -> None:
        cfg, a = self.cfg, self.addrs
        log(f"rank {cfg.rank}/{cfg.world} at {a.own_addr}, master {a.master_addr}:{a.port_base}, "
            f"generation {a.generation} (from {a.sources})")
        try:
            if cfg.deferred_join:
                self.engine = self.start(cfg.rank, cfg.world)
                self.join(a.master_addr, a.port_base, a.generation)
            else:
                self.join(a.master_addr, a.port_base, a.generation)
                self.engine = self.start(cfg.rank, cfg.world)
            warm_up(self.engine)
            self.engine.control_handlers["rebuild"] = self._rebuild_requested
            if cfg.store:
                from podsnap.snapshot.capture import snapshot_handler

                self.engine.control_handlers["snapshot"] = snapshot_handler(cfg.store)
                if cfg.process_hooks:
                    self.listen_for_criu()
            if cfg.rank == 0:
                self.lead()
            else:
                self.follow()
        finally:
            if self.checkpoint_hooks:
                self.checkpoint_hooks.close()
            groups.teardown()

    def listen_for_criu(self) -> None:
        """Serve the CRIU plugin's device hooks (pause/resume around a process checkpoint)."""
        from podsnap.criu_plugin.suspend import ProcessCheckpointHooks

        try:
            self.checkpoint_hooks = ProcessCheckpointHooks(self, self.cfg.store)
        except OSError as e:
            log(f"warning: process checkpoints are off: cannot listen for the CRIU plugin ({e}); "
                "set PODSNAP_HOOK_DIR to a directory this user may write")
            return
        log(f"rank {self.cfg.rank}: CRIU device hooks on {self.checkpoint_hooks.hooks.path}")

    def join(self, master_addr: str, port_base: int, generation: int, between=None,
             timeout_s: float | None = None) -> dict:
        t = groups.join(master_addr, port_base, generation, self.cfg.rank, self.cfg.world, self.cfg.backend,
                        timeout_s or self.cfg.connect_timeout_s, self.addrs.own_addr, between)
        self.master = (master_addr, port_base)
        self.last_join = {"generation": generation, **t.to_dict()}
        return self.last_join

    # --- rank 0 -------------------------------------------------------------------

    def lead(self) -> None:
        cfg = self.cfg
        server = self.server = EngineServer(self.engine, cfg.host, cfg.port, admin_token=cfg.admin_token)
        server.on_group_failure = lambda e: self.rebuild_as_leader("failure", {}, error=e)
        server.on_stop = self.leave_as_leader
        server.admin_routes["/admin/rebuild"] = self.admin_rebuild
        if cfg.store:
            server.admin_routes["/admin/snapshot"] = lambda body: admin_snapshot(server, cfg.store, body)
        self.publish_generation()
        signal.signal(signal.SIGTERM, lambda *_: server.stopping.set())
        signal.signal(signal.SIGINT, lambda *_: server.stopping.set())
        print(f"podsnap: serving on http://{cfg.host}:{server.port} (tp={cfg.world})", flush=True)
        server.serve_forever()

    def publish_generation(self) -> None:
        rdzv = groups.registry.rendezvous
        self.server.generation_info = {
            "generation": groups.registry.generation,
            "rendezvous_port": rdzv.port if rdzv else None,
            "active": rdzv.ready if rdzv else [True],
            "last_join": self.last_join,
        }
        if self.checkpoint_hooks:
            hooks = self.checkpoint_hooks
            self.server.generation_info["process_checkpoints"] = {
                "device_hooks": hooks.hooks.events.snapshot(),
                "suspensions": [asdict(s) for s in hooks.history]}

    def rebuild_as_leader(self, cause: str, params: dict, error: Exception | None = None) -> dict:
        """Form generation g+1 (or ``params["generation"]``) with every rank; requests queue meanwhile."""
        server = self.server
        t = time.perf_counter()
        if error is not None:
            log(f"group failure in generation {groups.registry.generation}: {str(error).splitlines()[0][:200]}")
        self.engine.scheduler.preempt_all()
        teardown_s = groups.teardown(timeout_s=10)
        generation = int(params.get("generation", groups.registry.generation + 1))
        port_base = int(params.get("port_base", self.master[1]))
        log(f"rebuilding: generation {generation} at {self.addrs.own_addr}, waiting for {self.cfg.world} ranks")
        self.join(self.addrs.own_addr, port_base, generation, between=server.keep_admitting,
                  timeout_s=params.get("timeout_s", 600))
        total = time.perf_counter() - t
        self.last_join.update(teardown=round(teardown_s, 6), total=round(total, 6), cause=cause)
        server.metrics.rebuilds.labels(cause).inc()
        server.metrics.rebuild_seconds.observe(total)
        self.publish_generation()
        log(f"generation {generation} formed in {total:.3f} s ({self.last_join})")
        return dict(self.last_join)

    def leave_as_leader(self) -> None:
        """Rank 0 is stopping (its pod is deleted or rescheduled): the followers wait for the next
        generation's master (named by their restore metadata) instead of exiting."""
        if self.cfg.world == 1 or not groups.is_distributed():
            return
        try:
            self.engine.collective({"op": "rebuild", "generation": groups.registry.generation + 1,
                                    "master_leaving": True})
        except RuntimeError:
            pass  # a follower is gone too; the others notice the closed group and rejoin anyway

    def admin_rebuild(self, body: bytes) -> tuple[int, dict]:
        """POST /admin/rebuild {"generation"?, "port_base"?, "leave"?: [ranks replaced by new pods]}."""
        try:
            req = parse_json_object(body, {"generation", "port_base", "leave", "timeout_s"})
            generation = req.get("generation", groups.registry.generation + 1)
            if type(generation) is not int or generation <= groups.registry.generation:
                raise BadRequest(f"generation {generation!r} must be an integer above the current "
                                 f"{groups.registry.generation}")
            leave = req.get("leave", [])
            if not isinstance(leave, list) or not all(type(r) is int and 0 < r < self.cfg.world for r in leave):
                raise BadRequest(f"'leave' must list follower ranks in 1..{self.cfg.world - 1}")
        except BadRequest as e:
            return bad_request(e)
        msg = {"op": "rebuild", "generation": generation, "port_base": req.get("port_base", self.master[1]),
               "leave": leave, "timeout_s": req.get("timeout_s", 600)}
        return self.server.submit_admin(msg)

    def _rebuild_requested(self, engine: LLMEngine, msg: dict):
        """The "rebuild" control op: rank 0 rebuilds here; followers leave follow() and rejoin."""
        if engine.rank == 0:
            return None if msg.get("master_leaving") else self.rebuild_as_leader("admin", msg)
        raise RebuildRequested(msg)

    # --- followers ------------------------------------------------------------------

    def follow(self) -> None:
        while True:
            try:
                self.engine.follow()
                return
            except RebuildRequested as r:
                if self.cfg.rank in r.msg.get("leave", []):
                    log(f"rank {self.cfg.rank}: replaced by a new pod in generation {r.msg['generation']}; exiting")
                    return
                target = None if r.msg.get("master_leaving") else r.msg
                if target is None:
                    log(f"rank {self.cfg.rank}: the master is leaving; waiting for generation {r.msg['generation']}")
            except RuntimeError as e:  # the group broke (a peer died)
                log(f"group failure in generation {groups.registry.generation}: {str(e).splitlines()[0][:200]}")
                target = None
            groups.teardown(timeout_s=10)
            self.rejoin(target)

    def rejoin(self, target: dict | None, timeout_s: float = 600) -> None:
        """Join the next generation: as told, or per a newer metadata file, or at g+1 of the known master."""
        current = groups.registry.generation
        deadline = time.monotonic() + timeout_s
        while True:
            meta = from_metadata_file(self.cfg.metadata)
            if target:
                addr, base, gen = self.master[0], int(target["port_base"]), int(target["generation"])
            elif meta and meta.generation > current:
                addr, base, gen = meta.master_addr, meta.port_base, meta.generation
            else:
                addr, base, gen = self.master[0], self.master[1], current + 1
            try:
                self.join(addr, base, gen, timeout_s=5)
                log(f"rank {self.cfg.rank} joined generation {gen} at {addr} ({self.last_join})")
                return
            except PodsnapError:
                if time.monotonic() > deadline:
                    raise PodsnapError(f"rank {self.cfg.rank}: no new generation to join within {timeout_s:g} s "
                                       f"(last tried {addr}:{base} generation {gen})") from None


def serve_rank(cfg: PodConfig, start) -> None:
    Pod(cfg, start).run()


def metadata_path_ok(path: str | None) -> str | None:
    if path and Path(path).is_dir():
        raise PodsnapError(f"--restore-metadata {path} is a directory; give the JSON file's path")
    return path
