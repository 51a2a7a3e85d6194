"""The serving front end of rank 0: an HTTP API over the engine's step loop.

    POST /v1/completions  {"prompt": [token ids], "max_tokens": N, "temperature": 0}
    GET  /health          200 {"status": "ok"} once the engine serves
    GET  /metrics         Prometheus text: tokens, requests, step latency, queue depth
    POST /admin/snapshot  {"name": optional, "with_kv": false, "portable": false}; needs --store
    POST /admin/rebuild   {"generation", "leave": [ranks]} (engine/pod.py)

The admin routes answer only loopback callers, or, when an admin token is
configured, callers that send ``Authorization: Bearer TOKEN``: they can
pause the engine and write process memory to storage.

HTTP handler threads validate a request and put it on the inbox; the step
loop (the main thread) admits inbox requests at step boundaries and runs
continuous batching. Admin operations (a snapshot) run between two steps
on every rank; while they run, requests wait in the inbox: they are queued,
never dropped.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import queue
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from podsnap.errors import PodsnapError

from .llm_engine import LLMEngine
from .scheduler import Sequence

MAX_BODY_BYTES = 1 << 20
HEARTBEAT_S = 1.0


class BadRequest(Exception):
    pass


@dataclass
class AdminOp:
    msg: dict  # the control op broadcast to every rank
    done: threading.Event = field(default_factory=threading.Event)
    result: dict | None = None
    error: str | None = None


@dataclass
class Completion:
    prompt: list[int]
    max_tokens: int
    done: threading.Event = field(default_factory=threading.Event)
    seq: Sequence | None = None
    error: str | None = None


def parse_json_object(body: bytes, allowed: set[str] | None = None) -> dict:
    """A request body as a JSON object (empty body: {}); BadRequest names what is wrong."""
    try:
        req = json.loads(body or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"body is not valid JSON: {e}") from None
    if not isinstance(req, dict):
        raise BadRequest("body must be a JSON object")
    unknown = set(req) - allowed if allowed is not None else set()
    if unknown:
        raise BadRequest(f"unknown field(s) {sorted(unknown)}; allowed: {', '.join(sorted(allowed))}")
    return req


def bad_request(e: Exception) -> tuple[int, dict]:
    return HTTPStatus.BAD_REQUEST, {"error": {"message": str(e), "type": "invalid_request_error"}}


def parse_completion(body: bytes) -> Completion:
    """Validate a /v1/completions body; BadRequest says what is wrong."""
    req = parse_json_object(body)
    prompt = req.get("prompt")
    if not isinstance(prompt, list) or not prompt or not all(type(t) is int for t in prompt):
        raise BadRequest("'prompt' must be a non-empty list of token ids (integers); this server has no tokenizer")
    max_tokens = req.get("max_tokens", 16)
    if type(max_tokens) is not int or max_tokens < 1:
        raise BadRequest(f"'max_tokens' must be a positive integer, got {max_tokens!r}")
    temperature = req.get("temperature", 0)
    if not isinstance(temperature, int | float) or temperature != 0:
        raise BadRequest(f"'temperature' {temperature!r} is not supported: only greedy decoding (0) is implemented")
    return Completion(prompt, max_tokens)


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.tokens = Counter("podsnap_generated_tokens", "Tokens generated", registry=self.registry)
        self.requests = Counter("podsnap_requests", "Completion requests by result", ["result"],
                                registry=self.registry)
        self.step_latency = Histogram("podsnap_step_latency_seconds", "Engine step latency", ["kind"],
                                      registry=self.registry,
                                      buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5))
        self.queued = Gauge("podsnap_queued_requests", "Requests waiting to be admitted", registry=self.registry)
        self.rebuilds = Counter("podsnap_rebuilds", "Group rebuilds by cause", ["cause"], registry=self.registry)
        self.rebuild_seconds = Histogram("podsnap_rebuild_seconds", "Group rebuild duration", registry=self.registry,
                                         buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300))
        self.running = Gauge("podsnap_running_requests", "Requests being generated", registry=self.registry)


class EngineServer:
    def __init__(self, engine: LLMEngine, host: str = "127.0.0.1", port: int = 8000, model_name: str = "podsnap",
                 admin_token: str | None = None):
        self.engine = engine
        self.model_name = model_name
        self.inbox: queue.Queue[Completion] = queue.Queue()
        self.admin: queue.Queue[AdminOp] = queue.Queue()
        self.active: dict[int, Completion] = {}
        self.metrics = Metrics()
        self.stopping = threading.Event()
        self.last_heartbeat = time.monotonic()
        self.admin_routes: dict = {}  # path -> fn(body) -> (status, payload), added by the pod
        self.admin_token = admin_token
        # called with the error when a step fails because the group broke (a rank died); it rebuilds
        self.on_group_failure = None
        self.on_stop = engine.stop_followers  # what rank 0 tells the followers when it stops
        self.generation_info: dict = {}
        self.startup = {**engine.timings.to_dict(), "restored": engine.restored_from is not None}
        self.connections: set = set()  # client sockets, closed when the listener closes
        self.http = self._listen(host, port)

    def _listen(self, host: str, port: int) -> ThreadingHTTPServer:
        http = ThreadingHTTPServer((host, port), self._handler_class())
        http.daemon_threads = True
        return http

    @property
    def port(self) -> int:
        return self.http.server_address[1]

    # --- the step loop (main thread) -------------------------------------------

    def _start_http(self) -> None:
        threading.Thread(target=self.http.serve_forever, name="http", daemon=True).start()

    def stop_listening(self, reason: str) -> None:
        """Close the listener and every client connection, answering the requests in flight with 503
        (``reason``) so that clients retry: a process checkpoint carries no TCP socket to a new pod."""
        self.http.shutdown()
        self.http.server_close()
        self.engine.scheduler.abort_all()
        for c in [*self.active.values(), *self._drain()]:
            c.error = reason
            c.done.set()
        self.active.clear()
        deadline = time.monotonic() + 5
        while self.connections and time.monotonic() < deadline:  # let the handlers send their 503s
            time.sleep(0.02)
        for sock in list(self.connections):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.metrics.running.set(0)
        self.metrics.queued.set(0)

    def start_listening(self, host: str) -> None:
        """Listen again (on the same port) after ``stop_listening``."""
        self.http = self._listen(host, self.port)
        self._start_http()

    def serve_forever(self) -> None:
        self._start_http()
        try:
            while not self.stopping.is_set():
                try:
                    self.run_admin_ops()
                    self.admit(block=not self.engine.scheduler.has_work)
                    if self.engine.scheduler.has_work:
                        self.step()
                    else:
                        self.heartbeat()
                except RuntimeError as e:  # gloo/nccl: a peer is gone or the group broke
                    if self.on_group_failure is None or self.engine.world_size == 1:
                        raise
                    self.on_group_failure(e)
        finally:
            self.http.shutdown()
            self.http.server_close()
            self.on_stop()
            for c in [*self.active.values(), *self._drain()]:
                c.error = "the server is shutting down"
                c.done.set()

    def _drain(self) -> list[Completion]:
        out = []
        while not self.inbox.empty():
            out.append(self.inbox.get_nowait())
        return out

    def run_admin_ops(self) -> None:
        """Run queued admin ops at this step boundary, on every rank."""
        while not self.admin.empty():
            op = self.admin.get_nowait()
            t = time.perf_counter()
            try:
                op.result = self.engine.collective(op.msg) or {}
                op.result["paused_seconds"] = round(time.perf_counter() - t, 6)
            except Exception as e:  # reported to the caller; the engine keeps serving
                op.error = f"{type(e).__name__}: {e}" if not isinstance(e, PodsnapError) else str(e)
                if isinstance(e, RuntimeError) and not isinstance(e, PodsnapError):
                    op.done.set()
                    raise  # the group broke: the serve loop rebuilds it
            op.done.set()

    def enqueue_admin(self, msg: dict) -> AdminOp:
        """Queue a control op for the next step boundary; ``op.done`` is set when it has run."""
        op = AdminOp(msg)
        self.admin.put(op)
        return op

    def submit_admin(self, msg: dict) -> tuple[int, dict]:
        op = self.enqueue_admin(msg)
        op.done.wait()
        if op.error:
            return HTTPStatus.INTERNAL_SERVER_ERROR, {"error": {"message": op.error, "type": "server_error"}}
        return HTTPStatus.OK, op.result

    def heartbeat(self) -> None:
        """When idle, check the group with a no-op collective about once a second, so a dead rank is
        noticed (and the group rebuilt) before the next request needs it."""
        now = time.monotonic()
        if self.engine.world_size > 1 and now - self.last_heartbeat > HEARTBEAT_S:
            self.last_heartbeat = now
            self.engine.collective({"op": "ping"})

    def keep_admitting(self) -> None:
        """While the group is being rebuilt: take requests into the queue, run nothing."""
        self.admit(block=True)

    def admit(self, block: bool) -> None:
        """Move inbox requests into the scheduler (waits briefly for one when idle)."""
        try:
            first = self.inbox.get(timeout=0.05) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        for c in [first, *self._drain()]:
            try:
                c.seq = self.engine.add_request(c.prompt, c.max_tokens)
                self.active[c.seq.seq_id] = c
            except PodsnapError as e:
                c.error = str(e)
                c.done.set()
        self.metrics.queued.set(self.inbox.qsize())
        self.metrics.running.set(len(self.active))

    def step(self) -> None:
        t = time.perf_counter()
        result = self.engine.step()
        self.metrics.step_latency.labels("prefill" if result.prefill else "decode").observe(time.perf_counter() - t)
        self.metrics.tokens.inc(len(result.seqs))
        for seq in result.finished:
            c = self.active.pop(seq.seq_id)
            self.metrics.requests.labels("ok").inc()
            c.done.set()
        self.metrics.running.set(len(self.active))

    # --- HTTP (handler threads) ------------------------------------------------

    def submit(self, body: bytes) -> tuple[int, dict]:
        try:
            c = parse_completion(body)
            self.engine.validate_request(c.prompt, c.max_tokens)
        except (BadRequest, PodsnapError) as e:
            self.metrics.requests.labels("bad_request").inc()
            return bad_request(e)
        self.inbox.put(c)
        self.metrics.queued.set(self.inbox.qsize())
        c.done.wait()
        if c.error:
            self.metrics.requests.labels("error").inc()
            return HTTPStatus.SERVICE_UNAVAILABLE, {"error": {"message": c.error, "type": "server_error"}}
        out = c.seq.output_ids
        return HTTPStatus.OK, {
            "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": self.model_name,
            "choices": [{"index": 0, "text": " ".join(map(str, out)), "token_ids": out,
                         "finish_reason": "length", "logprobs": None}],
            "usage": {"prompt_tokens": len(c.prompt), "completion_tokens": len(out),
                      "total_tokens": len(c.prompt) + len(out)}}

    def _handler_class(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, fmt, *args):  # keep stderr for errors
                pass

            def setup(self):
                super().setup()
                server.connections.add(self.connection)

            def finish(self):
                server.connections.discard(self.connection)
                super().finish()

            def send(self, status: int, payload, content_type: str = "application/json") -> None:
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/health":
                    self.send(HTTPStatus.OK, {"status": "ok", "world_size": server.engine.world_size,
                                              "startup": server.startup, **server.generation_info})
                elif self.path == "/metrics":
                    self.send(HTTPStatus.OK, generate_latest(server.metrics.registry), CONTENT_TYPE_LATEST)
                else:
                    self.send(HTTPStatus.NOT_FOUND, {"error": {"message": f"no route GET {self.path}"}})

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                if length > MAX_BODY_BYTES:
                    self.send(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                              {"error": {"message": f"body of {length} bytes exceeds {MAX_BODY_BYTES}"}})
                    return
                body = self.rfile.read(length)
                if self.path == "/v1/completions":
                    self.send(*server.submit(body))
                elif self.path in server.admin_routes:
                    denied = admin_denied(server.admin_token, self.client_address[0], self.headers.get("Authorization"))
                    self.send(*(denied or server.admin_routes[self.path](body)))
                else:
                    self.send(HTTPStatus.NOT_FOUND, {"error": {"message": f"no route POST {self.path}"}})

        return Handler


def admin_denied(token: str | None, peer: str, authorization: str | None) -> tuple[int, dict] | None:
    """None if the caller may use the admin API, else the (status, error) to answer."""
    if token:
        if authorization and hmac.compare_digest(authorization.encode(), f"Bearer {token}".encode()):
            return None
        return HTTPStatus.UNAUTHORIZED, {"error": {"message": "admin API: send Authorization: Bearer <token>"}}
    if ipaddress.ip_address(peer.removeprefix("::ffff:")).is_loopback:
        return None
    return HTTPStatus.FORBIDDEN, {"error": {"message": f"admin API is served to loopback callers only (not {peer}); "
                                                       "start the server with an admin token to allow others"}}


def admin_snapshot(server: EngineServer, store: str, body: bytes) -> tuple[int, dict]:
    """Validate a snapshot request in the handler thread; run it at the next step boundary."""
    from podsnap.snapshot.store import Store, StoreError, check_snapshot_id, new_snapshot_id

    try:
        req = parse_json_object(body, {"name", "with_kv", "portable"})
        name = check_snapshot_id(req["name"]) if req.get("name") is not None else new_snapshot_id()
        flags = {k: req.get(k, False) for k in ("with_kv", "portable")}
        if not all(isinstance(v, bool) for v in flags.values()):
            raise BadRequest("'with_kv' and 'portable' must be true or false")
    except (BadRequest, StoreError) as e:
        return bad_request(e)
    if Store(store).manifest_path(name).exists():
        return HTTPStatus.CONFLICT, {"error": {"message": f"snapshot {name!r} already exists in {store}"}}
    return server.submit_admin({"op": "snapshot", "name": name, **flags})
