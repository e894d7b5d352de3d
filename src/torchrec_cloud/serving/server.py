"""``torchrec-cloud serve MODEL``: an HTTP server that scores raw rows with an exported model,
over KServe's Open Inference Protocol (v2) and its v1 protocol::

    torchrec-cloud serve models/ev --name ev --port 8080
    torchrec-cloud serve s3://bucket/published/ev --name ev     # a published root: follows ROOT/current
    curl -s localhost:8080/v1/models/ev:predict -d '{"instances": [{"user": "u0001", "tags": ["t1"]}]}'

MODEL is a model folder as ``export`` writes it (local or a bucket URL), or a published root
(``ROOT/current`` names the version folder; a new version is swapped in while serving, see
:mod:`~torchrec_cloud.serving.versions`). Rows carry the schema's columns, raw (v1: one JSON
object per row; v2: one input tensor per column, shape ``[N]``); they are converted by the
model (:mod:`~torchrec_cloud.serving.model`, the conversion ``predict --input`` runs), so a
row scores as it does there. Concurrent requests are scored together (``--max_batch_size``
rows, waiting at most ``--max_delay_ms``); a full queue (``--max_queue``) answers 503 with
``Retry-After`` at once. On SIGTERM the server is no longer ready, scores what it holds,
answers it and exits 0 (within ``--grace_s``). Metrics at ``/metrics`` (Prometheus), one
access-log line per request on stderr. This module is the protocol; the model knows no HTTP.

Starlette on uvicorn (httptools and uvloop when installed, else h11 and asyncio): docs/serving.md says why not
KServe's own server. ``--workers N``: N such servers on one port under a supervisor
(:mod:`~torchrec_cloud.serving.workers`), the tables shared (mapped from ``tables.pt``).
The inference endpoints are answered by :class:`Inference`'s steps (a request costs its JSON
and a check of its values; the model converts a batch's requests together): below uvicorn's
ASGI layer with httptools (:mod:`~torchrec_cloud.serving.inference_http`), else on raw ASGI
messages; the rest of the API by Starlette. Metrics and the access log:
:mod:`~torchrec_cloud.serving.observe`.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import re
import signal
import socket
import threading
import time
from typing import Any, Optional

from torchrec_cloud.config import ConfigError
from torchrec_cloud.serving import ServingError, add_command, write_line
from torchrec_cloud.serving.model import CRITEO_HEX, CRITEO_INT, IDS, NUMBER, RequestError
from torchrec_cloud.serving.observe import Access, LiveGauges, Metrics
from torchrec_cloud.serving.requests import Refused, decode, decode_v1, rows_v2

# -- the server ------------------------------------------------------------------------------


class State:
    """What the endpoints read: the model served (swapped whole), readiness, the batcher."""

    def __init__(self, ns: argparse.Namespace, model: Any, metrics: Metrics, worker: Any = None) -> None:
        from torchrec_cloud.serving.batcher import Batcher, TurnBatcher

        self.ns, self.model, self.metrics = ns, model, metrics
        self.worker = worker  # serving.workers.WorkerInfo of a worker process, else None
        self._server_ready = worker is None
        self.name = ns.name
        self.loaded = False
        self.draining = False
        self.draining_since = 0.0  # set by the signal handler itself, before anything else
        self.failed: Optional[str] = None
        self.access = Access(metrics, None if worker is None else worker.index)
        if ns.max_delay_ms > 0:
            self.batcher: Any = Batcher(lambda: self.model, ns.max_batch_size, ns.max_delay_ms / 1000, ns.max_queue,
                                        on_batch=metrics.batch_rows.observe)  # fmt: skip
        else:  # a turn of the event loop's requests, scored after it on the loop's thread
            self.batcher = TurnBatcher(lambda: self.model, ns.max_batch_size, ns.max_queue,
                                       on_batch=metrics.batch_rows.observe)  # fmt: skip
        self.gauges = LiveGauges(metrics, self.batcher.depth)

    @property
    def ready(self) -> bool:
        if not self._server_ready and self.worker is not None:
            self._server_ready = self.worker.server_ready()  # every worker loaded: stays so (a replacement loads first)
        return self.loaded and not self.draining and not self.draining_since and self._server_ready

    def swap(self, model: Any) -> None:
        old = self.model
        self.model = model  # the batcher reads it once per batch
        self.metrics.version.labels(old.version).set(0)  # what a multiprocess scrape keeps of it
        self.metrics.version.remove(old.version)
        self.metrics.version.labels(model.version).set(1)
        self.metrics.swaps.inc()
        log(f"serving {self.name} version {model.version} (was {old.version})")
        del old
        settle_memory()

    def refuse(self, version: str, why: str) -> None:
        self.metrics.refused.inc()
        log(f"refused version {version}: {why}; still serving {self.model.version}")

    def drain(self) -> None:
        """SIGTERM: not ready from now on; what is queued is scored at once."""
        if not self.draining:
            self.draining = True
            log(f"SIGTERM: not ready; answering {self.batcher.depth()} queued request(s) and what is in flight, "
                f"then exiting (grace {self.ns.grace_s:g}s)")  # fmt: skip
            self.batcher.close()


_TAG = "torchrec-cloud serve"  # "torchrec-cloud serve[worker 1]" in a worker process


def log(line: str) -> None:
    write_line(f"{_TAG}: {line}")


def settle_memory() -> None:
    """Once a model is loaded (or swapped in): what exists now lives as long as the model, so
    it is moved out of the cyclic collector's sight (``gc.freeze``). Otherwise every full
    collection walks the model and the libraries while holding the GIL, and each request in
    flight waits it out (the tail of small requests' latency, bench/RESULTS.md). The previous
    freeze is undone first, so a swapped-out model's cycles are still collected."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


def _error(status: int, message: str, retry_after: bool = False) -> Any:
    from starlette.responses import JSONResponse

    headers = {"Retry-After": "1"} if retry_after else None
    return JSONResponse({"error": " ".join(message.split())}, status_code=status, headers=headers)


def build_app(state: State) -> Any:
    """The Starlette application: the v2 and v1 endpoints, /metrics, and the access log."""
    from prometheus_client import CONTENT_TYPE_LATEST
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    ns, metrics = state.ns, state.metrics

    def known(request: Any) -> None:
        if request.path_params["name"] != state.name:
            raise Refused(404, f"no model named {request.path_params['name'][:64]!r}; this server has {state.name!r}")

    async def live(request: Any) -> Any:
        return JSONResponse({"live": True})

    async def ready(request: Any) -> Any:
        return JSONResponse({"ready": state.ready}, status_code=200 if state.ready else 503)

    async def server_metadata(request: Any) -> Any:
        from torchrec_cloud import __version__

        return JSONResponse({"name": "torchrec-cloud", "version": __version__, "extensions": []})

    async def model_metadata(request: Any) -> Any:
        known(request)
        m = state.model
        v2 = {IDS: "BYTES", CRITEO_HEX: "BYTES", NUMBER: "FP64", CRITEO_INT: "INT64"}
        return JSONResponse({
            "name": state.name, "versions": [m.version], "platform": "pytorch_aoti" if m.scorer.runtime == "pt2" else "pytorch_torchscript",
            "inputs": [{"name": c.name, "datatype": v2.get(c.kind, "BYTES"), "shape": [-1]} for c in m.columns],
            "outputs": [{"name": "probability", "datatype": "FP64", "shape": [-1]}],
        })  # fmt: skip

    async def model_ready(request: Any) -> Any:
        known(request)
        return JSONResponse({"name": state.name, "ready": state.ready}, status_code=200 if state.ready else 503)

    async def v1_model(request: Any) -> Any:
        known(request)
        return JSONResponse({"name": state.name, "ready": state.ready})

    async def prometheus(request: Any) -> Any:
        return Response(metrics.scrape(), media_type=CONTENT_TYPE_LATEST)

    def guarded(handler: Any, endpoint: str) -> Any:
        async def run(request: Any) -> Any:
            request.scope.setdefault("torchrec_serve", {})["endpoint"] = endpoint
            try:
                return await handler(request)
            except Refused as e:
                return _error(e.status, str(e), e.retry_after)
            except Exception as e:  # noqa: BLE001 - a fault of ours: one line, never a traceback to the client
                log(f"{request.method} {request.url.path}: {type(e).__name__}: {' '.join(str(e).split())[:300]}")
                return _error(500, f"internal error ({type(e).__name__})")

        return run

    routes = [
        Route("/v2/health/live", guarded(live, "live"), methods=["GET"]),
        Route("/v2/health/ready", guarded(ready, "ready"), methods=["GET"]),
        Route("/v2", guarded(server_metadata, "metadata"), methods=["GET"]),
        Route("/v2/models/{name}", guarded(model_metadata, "metadata"), methods=["GET"]),
        Route("/v2/models/{name}/ready", guarded(model_ready, "ready"), methods=["GET"]),
        Route("/v1/models/{name}", guarded(v1_model, "metadata"), methods=["GET"]),
        Route("/metrics", guarded(prometheus, "metrics"), methods=["GET"]),
    ]
    return Inference(state, AccessLog(Starlette(routes=routes), state.access))


class Inference:
    """ASGI: ``POST /v1/models/NAME:predict`` and ``POST /v2/models/NAME/infer``, answered here
    on raw ASGI messages and recorded by :class:`Access`, everything else passed to ``app``
    (Starlette, in :class:`AccessLog`); its steps (``admit``, ``parse``, ``submit``, ``scored``)
    are also those of the answers given below ASGI (:mod:`.inference_http`). A one-row request
    costs little more than its JSON: no framework objects, the values checked in Python and
    handed to the batcher as they are (the model converts a batch's requests together). A
    request that cannot be queued (a full queue, an oversized body, a model not loaded) is
    answered before its body is read, with a body encoded once."""

    PATHS = re.compile(r"/v1/models/([^/]+):predict|/v2/models/([^/]+)/infer")

    def __init__(self, state: State, app: Any) -> None:
        self.state, self.app = state, app
        ns = state.ns
        self.queue_full = _error_body(f"the queue is full ({ns.max_queue} requests, --max_queue): retry")
        self.not_loaded = _error_body(f"model {state.name} is not loaded yet")
        self.access, self.gauges = state.access, state.gauges
        self.answers = Answers()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        match = self.PATHS.fullmatch(scope["path"]) if scope["type"] == "http" else None
        if match is None:
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        protocol, name = ("v1", match.group(1)) if match.group(1) is not None else ("v2", match.group(2))
        info = scope.setdefault("torchrec_serve", {})
        info["endpoint"] = protocol
        self.gauges.flight(1)
        try:
            if scope["method"] != "POST":
                raise Refused(405, f"{scope['method'][:10]} is not allowed here: POST a request")
            status, body, headers = await self.answer(scope, receive, info, protocol, name)
        except Refused as e:
            status, body, headers = self.refusal(e)
        except Exception as e:  # noqa: BLE001 - a fault of ours: one line, never a traceback to the client
            status, body, headers = self.failure(f"POST {scope['path']}", e)
        finally:
            self.gauges.flight(-1)
        if status == 405:
            headers.append((b"allow", b"POST"))
        headers += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        try:
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body})
        finally:
            self.access.record(scope, info, status, time.perf_counter() - start)

    async def answer(self, scope: Any, receive: Any, info: dict, protocol: str, name: str) -> tuple[int, bytes, list]:
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), b"")
        early = self.admit(name, declared)
        if early is not None:
            return early
        payload, rows = self.parse(protocol, await read_body(receive, self.state.ns.max_body_bytes), info)
        loop = asyncio.get_running_loop()
        answer = loop.create_future()
        item = self.submit(rows, lambda value: answer.done() or answer.set_result(value), loop)
        if item is None:
            return 503, self.queue_full, [(b"retry-after", b"1")]
        timer = loop.call_later(self.state.ns.timeout_s, lambda: answer.done() or answer.set_exception(asyncio.TimeoutError()))
        try:
            result, model = await answer
        except asyncio.TimeoutError:
            raise self.timed_out(item) from None
        finally:
            timer.cancel()
        return self.scored(protocol, payload, result, model, info)

    # The steps of a request, shared with the answers given below ASGI (serving.inference_http).

    @staticmethod
    def refusal(e: Refused) -> tuple[int, bytes, list]:
        return e.status, _error_body(str(e)), [(b"retry-after", b"1")] if e.retry_after else []

    @staticmethod
    def failure(where: str, e: Exception) -> tuple[int, bytes, list]:
        """A fault of ours: one log line, and a one-line 500, never a traceback to the client."""
        log(f"{where[:200]}: {type(e).__name__}: {' '.join(str(e).split())[:300]}")
        return 500, _error_body(f"internal error ({type(e).__name__})"), []

    def admit(self, name: str, declared: bytes) -> Optional[tuple[int, bytes, list]]:
        """Before the body is read: a wrong name or a declared body over the cap is Refused; a
        model not loaded yet or a full queue is answered (503) at once; None: read the body."""
        state, ns = self.state, self.state.ns
        if name != state.name:
            raise Refused(404, f"no model named {name[:64]!r}; this server has {state.name!r}")
        if not state.loaded:
            return 503, self.not_loaded, [(b"retry-after", b"1")]
        if declared.isdigit() and int(declared) > ns.max_body_bytes:
            raise Refused(413, f"the body has {declared.decode()} bytes: over the limit of {ns.max_body_bytes} "
                               "(--max_body_bytes)")  # fmt: skip
        if state.batcher.full():  # shed before reading the body: the cheapest answer there is
            return 503, self.queue_full, [(b"retry-after", b"1")]
        return None

    def parse(self, protocol: str, body: bytes, info: dict) -> tuple[Any, Any]:
        """The body's JSON and its rows, checked (Refused: a 4xx naming the column or limit)."""
        ns, model = self.state.ns, self.state.model
        columns = model.columns  # the same for every version (a swap checks it)
        if protocol == "v1":
            payload, rows = decode_v1(body, columns, ns.max_request_rows, model.plain)
        else:
            payload = decode(body)
            rows = rows_v2(payload, columns, ns.max_request_rows)
        info["rows"] = rows.num_rows
        return payload, rows

    def submit(self, rows: Any, settle: Any, loop: asyncio.AbstractEventLoop) -> Any:
        """Queue the rows; ``settle((result, model))`` is called on ``loop`` once they are
        scored. None: the queue is full."""
        batcher = self.state.batcher
        if batcher.on_loop:
            item = batcher.submit(rows, rows.num_rows, lambda r, m: settle((r, m)))
        else:  # scored on the batcher's thread: the answer crosses back to the loop
            item = batcher.submit(rows, rows.num_rows, lambda r, m: self.answers.put(loop, settle, (r, m)))
        self.gauges.changed()
        return item

    def timed_out(self, item: Any) -> Refused:
        self.state.batcher.cancel(item)
        self.gauges.changed()
        return Refused(504, f"not scored within {self.state.ns.timeout_s:g}s (--timeout_s)")

    def scored(self, protocol: str, payload: Any, result: Any, model: Any, info: dict) -> tuple[int, bytes, list]:
        """The answer to rows scored by ``model``: their probabilities, or the error they raised."""
        info["version"] = model.version
        if isinstance(result, RequestError):
            raise Refused(400, str(result))
        if isinstance(result, Exception):
            log(f"scoring failed: {type(result).__name__}: {' '.join(str(result).split())[:300]}")
            raise Refused(500, f"scoring failed ({type(result).__name__}); the server log says more")
        probabilities = result.tolist()
        headers = [(b"x-model-version", version_header(model.version))]
        if protocol == "v1":
            if _orjson_dumps is not None and math.isfinite(math.fsum(probabilities)):  # json: NaN is refused, orjson writes null
                return 200, _orjson_dumps({"predictions": probabilities}), headers
            return 200, _json({"predictions": probabilities}), headers
        out = {"model_name": self.state.name, "model_version": model.version,
               "outputs": [{"name": "probability", "shape": [len(probabilities)], "datatype": "FP64", "data": probabilities}]}  # fmt: skip
        if isinstance(payload.get("id"), str):
            out["id"] = payload["id"][:256]
        return 200, _json(out), headers


def version_header(version: str) -> bytes:
    """A model version as an HTTP header value: a folder's name can hold what a header cannot
    (a control character), which is escaped."""
    value = _VERSION_HEADERS.get(version)
    if value is None:
        value = _VERSION_HEADERS[version] = re.sub(rb"[\x00-\x1f\x7f]", lambda m: b"\\x%02x" % m.group()[0],
                                                   version.encode("utf-8", "backslashreplace"))  # fmt: skip
    return value


_VERSION_HEADERS: dict[str, bytes] = {}


class Answers:
    """Results from the batcher's thread to the event loop: one wake-up of the loop for a
    batch's answers, not one per request."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list = []
        self._scheduled = False

    def put(self, loop: asyncio.AbstractEventLoop, settle: Any, value: Any) -> None:
        """From any thread: ``settle(value)`` is called on ``loop``."""
        with self._lock:
            self._pending.append((settle, value))
            if self._scheduled:
                return
            self._scheduled = True
        loop.call_soon_threadsafe(self._settle)

    def _settle(self) -> None:
        with self._lock:
            pending, self._pending, self._scheduled = self._pending, [], False
        for settle, value in pending:
            try:
                settle(value)
            except Exception as e:  # noqa: BLE001 - one request's fault of ours: the others are still answered
                log(f"answering a request: {type(e).__name__}: {' '.join(str(e).split())[:300]}")


async def read_body(receive: Any, cap: int) -> bytes:
    """The request's body, refused (413) as soon as it passes ``cap`` bytes."""
    chunks, size, more = [], 0, True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise Refused(400, "the client closed the connection before sending its whole body")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > cap:
            raise Refused(413, f"the body is over the limit of {cap} bytes (--max_body_bytes)")
        chunks.append(chunk)
        more = message.get("more_body", False)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


try:  # the serve extra installs it; json writes the same answers
    from orjson import dumps as _orjson_dumps
except ImportError:  # pragma: no cover - depends on what is installed
    _orjson_dumps = None


def _json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), allow_nan=False).encode()


def _error_body(message: str) -> bytes:
    return _json({"error": " ".join(message.split())})


class AccessLog:
    """ASGI wrapper of the API Starlette answers: each request recorded by :class:`Access`."""

    def __init__(self, app: Any, access: Access) -> None:
        self.app, self.access = app, access

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        info = scope.setdefault("torchrec_serve", {})
        status = [500]

        async def sending(message: Any) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            self.access.record(scope, info, status[0], time.perf_counter() - start)


def event_loop() -> str:
    """uvicorn's event loop: uvloop (libuv, compiled) when it imports (the ``serve`` extra
    installs it), else asyncio's own (pure Python around the selector: more of a small
    request's CPU time, bench/RESULTS.md)."""
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def http_parser() -> str:
    """uvicorn's HTTP parser: httptools (C, llhttp) when installed (the ``serve`` extra installs
    it), else h11 (pure Python: more of a small request's CPU time, bench/RESULTS.md)."""
    try:
        import httptools  # noqa: F401
    except ImportError:  # not installed, or not importable here
        return "h11"
    return "httptools"


def serve(ns: argparse.Namespace) -> int:
    """Load the model in the background, answer requests until SIGTERM, then drain and return 0.
    With ``--workers N`` (N > 1) this process supervises N worker processes that do this
    (:mod:`~torchrec_cloud.serving.workers`)."""
    global _TAG
    from torchrec_cloud.serving.versions import Follower, first_model, is_root
    from torchrec_cloud.serving.workers import Supervisor, WorkerInfo, worker_argv

    model = first_model(ns.model, ns.runtime)  # a folder that is no model stops here, before listening
    if ns.workers > 1:
        return Supervisor(ns, worker_argv(ns, ns.serve_flags)).run()
    worker = WorkerInfo.from_env()
    import torch
    import uvicorn

    from torchrec_cloud.launch import cpu_count

    if worker is not None:
        _TAG = f"torchrec-cloud serve[worker {worker.index}]"
        worker.follow_parent()
    # With a batcher thread (--max_delay_ms above 0) the event loop parses requests while it
    # scores: torch's threads spinning on every core would take the loop's core from it (from
    # each worker's). Scored on the loop's thread, a batch has the worker's share of the cores.
    workers = 1 if worker is None else worker.workers
    cores = cpu_count() - (workers if ns.max_delay_ms > 0 else 0)
    torch.set_num_threads(ns.num_threads or max(1, cores // workers))
    metrics = Metrics()
    state = State(ns, model, metrics, worker)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            # uvicorn re-raises the signal after its shutdown (exit status 143); a drained server exits 0.
            # Not ready at once; the rest in a thread: a signal handler that prints could interrupt a print.
            state.draining_since = state.draining_since or time.monotonic()
            threading.Thread(target=state.drain, name="drain").start()
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True

    app, parser = build_app(state), http_parser()
    if parser == "httptools":  # the inference endpoints answered below ASGI (serving.inference_http)
        from torchrec_cloud.serving.inference_http import protocol_class

        http: Any = protocol_class(app)
    else:
        http = parser
    config = uvicorn.Config(app, host=ns.host, port=ns.port, access_log=False, log_level="warning",
                            lifespan="off", timeout_graceful_shutdown=ns.grace_s, server_header=False,
                            proxy_headers=False, http=http, loop=event_loop())  # fmt: skip
    server = Server(config)

    def load() -> None:
        try:
            model.load()
        except Exception as e:  # noqa: BLE001 - a model that does not load ends the server, named
            state.failed = " ".join(str(e).split()) if isinstance(e, ServingError) else f"{type(e).__name__}: {e}"
            server.should_exit = True
            return
        metrics.version.labels(model.version).set(1)
        settle_memory()
        state.loaded = True
        tables = f"tables mapped from {model.scorer.mapped}" if model.scorer.mapped else "tables in this process"
        log(f"ready: {state.name} version {model.version} on http://{ns.host}:{ns.port} "
            f"(/v1/models/{state.name}:predict, /v2/models/{state.name}/infer, /metrics; {tables}; "
            f"HTTP parser {parser}, event loop {config.loop})")  # fmt: skip
        if worker is not None:
            worker.report_ready()
        if ns.follow:
            follower = Follower(ns.model, lambda: state.model, state.swap, state.refuse, ns.poll_s, ns.runtime)
            threading.Thread(target=follower.run, name="versions", daemon=True).start()

    ns.follow = is_root(ns.model)
    batcher = threading.Thread(target=state.batcher.run, name="batcher", daemon=True)
    if not state.batcher.on_loop:
        batcher.start()
    if worker is not None and worker.load_first:  # a replacement: the other workers answer while it loads
        load()
    else:
        threading.Thread(target=load, name="load", daemon=True).start()
    sockets = None if worker is None else [socket.socket(fileno=worker.listen_fd)]
    try:
        if not state.failed:
            server.run(sockets=sockets)
    except SystemExit:  # uvicorn's answer to an address it cannot bind (it logged why)
        raise ServingError(f"could not listen on {ns.host}:{ns.port} (in use, or not an address of this host)") from None
    finally:
        state.batcher.stop()
        if batcher.is_alive():
            batcher.join(timeout=ns.grace_s)
        state.access.flush()
    if state.failed:
        raise ServingError(state.failed)
    log("stopped")
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    summary = "serve an exported model over HTTP (KServe v1/v2 protocols): raw rows in, probabilities out"
    parser = add_command(subparsers, "serve", summary, __doc__, _main)
    parser.add_argument("model", metavar="MODEL",
                        help="a model folder (`export --output`), a published root (ROOT/current), or a bucket URL")  # fmt: skip
    parser.add_argument("--name", default="model", help="the model's name in the URLs (/v2/models/NAME/infer)")
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on")
    parser.add_argument("--port", type=int, default=8080, help="port to listen on")
    parser.add_argument("--max_batch_size", type=int, default=256, help="rows scored together at most")
    parser.add_argument("--max_delay_ms", type=float, default=0.0,
                        help="how long the first request of a batch waits for others to join it (0: none; the "
                             "requests of one turn of the event loop are scored together after it)")  # fmt: skip
    parser.add_argument("--max_queue", type=int, default=256, help="requests waiting at most; then 503 at once")
    parser.add_argument("--timeout_s", type=float, default=30.0, help="a request not scored by then is answered 504")
    parser.add_argument("--max_body_bytes", type=int, default=16 << 20, help="a larger request body is answered 413")
    parser.add_argument("--max_request_rows", type=int, default=8192, help="more rows in one request are answered 413")
    parser.add_argument("--poll_s", type=float, default=10.0, help="a published root: how often to read ROOT/current")
    parser.add_argument("--runtime", choices=("auto", "pt2", "torchscript"), default="auto",
                        help="auto: the model folder's AOTInductor package (scorer.pt2) when this torch built it, "
                             "else its TorchScript (scorer.pt)")  # fmt: skip
    parser.add_argument("--num_threads", type=int, default=0,
                        help="torch threads that score a batch, per worker (0: cores / workers, or with "
                             "--max_delay_ms above 0 (cores - workers) / workers, leaving each worker's HTTP side a "
                             "core; at least 1)")  # fmt: skip
    parser.add_argument("--grace_s", type=float, default=25.0,
                        help="on SIGTERM, how long queued and in-flight requests have to finish")  # fmt: skip
    parser.add_argument("--workers", type=int, default=1,
                        help="worker processes answering on the one port, each with its batcher, sharing the "
                             "mapped tables (docs/serving.md: when to raise it)")  # fmt: skip
    parser.set_defaults(serve_flags=[a.dest for a in parser._actions if a.option_strings and a.dest != "help"])
    return parser


def _main(ns: argparse.Namespace) -> int:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", ns.name):
        raise ConfigError("name", f"must be letters, digits, '_', '.', '-' (at most 64), got {ns.name[:70]!r}")
    if not 0 <= ns.port <= 65535:
        raise ConfigError("port", f"must be 0..65535, got {ns.port}")
    if ns.workers < 1:
        raise ConfigError("workers", f"must be >= 1, got {ns.workers}")
    if ns.num_threads < 0:
        raise ConfigError("num_threads", f"must be >= 0 (0: from the cores and --workers), got {ns.num_threads}")
    for flag in ("max_batch_size", "max_queue", "max_body_bytes", "max_request_rows"):
        if getattr(ns, flag) <= 0:
            raise ConfigError(flag, f"must be > 0, got {getattr(ns, flag)}")
    for flag in ("max_delay_ms", "timeout_s", "poll_s", "grace_s"):
        value = getattr(ns, flag)
        if not (math.isfinite(value) and value >= 0) or (flag != "max_delay_ms" and value == 0):
            raise ConfigError(flag, f"must be a finite number {'>= 0' if flag == 'max_delay_ms' else '> 0'}, got {value}")
    return serve(ns)
