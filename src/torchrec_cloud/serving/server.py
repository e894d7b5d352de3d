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

Starlette on uvicorn (h11, pure Python): docs/serving.md says why not KServe's own server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import signal
import sys
import threading
import time
from typing import Any, Optional

from torchrec_cloud.config import ConfigError
from torchrec_cloud.serving import ServingError, add_command
from torchrec_cloud.serving.model import CRITEO_HEX, CRITEO_INT, IDS, NUMBER, Column, RequestError

V2_TYPES = {"INT32": "int", "INT64": "int", "FP32": "float", "FP64": "float", "BYTES": "text"}


class Refused(Exception):
    """A request answered with ``status`` and a one-line JSON error."""

    def __init__(self, status: int, message: str, retry_after: bool = False) -> None:
        super().__init__(message)
        self.status, self.retry_after = status, retry_after


# -- requests to rows ------------------------------------------------------------------------


def _type(v: Any) -> str:
    return "null" if v is None else {bool: "a boolean", int: "an integer", float: "a number", str: "text",
                                     list: "a list", dict: "an object"}.get(type(v), type(v).__name__)  # fmt: skip


def column_array(c: Column, values: list, where: str) -> Any:
    """A request column's values (decoded JSON) as a pyarrow array the model converts: numbers,
    ids or lists as they are, or, when any value is text, the column as CSV-cell text (an empty
    string is missing). A value of the wrong type is a Refused(400) naming the column and row."""
    import pyarrow as pa

    def wrong(i: int, expected: str) -> Refused:
        return Refused(400, f"{where} {c.name}: row {i}: expected {expected}, got {_type(values[i])}")

    values = [None if v == "" else v for v in values]
    if c.kind == IDS:
        texts = any(isinstance(v, str) for v in values)
        for i, v in enumerate(values):
            if v is None or isinstance(v, str):
                continue
            if not isinstance(v, list) or any(isinstance(x, bool) or not isinstance(x, (int, str)) for x in v):
                raise wrong(i, f"a list of ids, or text with ids joined by {c.separator!r}")
        if texts:
            return pa.array([v if not isinstance(v, list) else c.separator.join(map(str, v)) for v in values], pa.string())
        inner_text = any(isinstance(x, str) for v in values if v for x in v)
        inner = pa.string() if inner_text else pa.int64()
        return pa.array([None if v is None else [str(x) for x in v] if inner_text else v for v in values], pa.list_(inner))
    allowed = {NUMBER: (int, float, str), CRITEO_INT: (int, str), CRITEO_HEX: (str,)}.get(c.kind, (int, float, str))
    expected = {NUMBER: "a number", CRITEO_INT: "an integer", CRITEO_HEX: "a hexadecimal id as text"}.get(c.kind, "an id")
    for i, v in enumerate(values):
        if v is not None and (isinstance(v, bool) or not isinstance(v, allowed)):
            raise wrong(i, expected)
        if isinstance(v, float) and not math.isfinite(v):
            raise Refused(400, f"{where} {c.name}: row {i}: {v!r} is not a finite number")
    if c.kind in (CRITEO_INT, CRITEO_HEX) or any(isinstance(v, str) for v in values):
        return pa.array([v if v is None or isinstance(v, str) else repr(v) for v in values], pa.string())
    if c.kind == NUMBER:
        try:
            return pa.array(values, pa.float64())
        except (pa.ArrowException, OverflowError):
            raise Refused(400, f"{where} {c.name}: a number out of range") from None
    if all(v is None for v in values):  # typed, so that an integer id column of nulls converts
        return pa.array(values, pa.string())
    try:
        return pa.array(values)
    except (pa.ArrowException, OverflowError):
        raise Refused(400, f"{where} {c.name}: ids must fit in 64 bits") from None


def rows_v1(payload: Any, columns: list[Column], max_rows: int) -> Any:
    """``{"instances": [{column: value, ...}, ...]}`` as a pyarrow table of the model's columns."""
    import pyarrow as pa

    if not isinstance(payload, dict) or not isinstance(payload.get("instances"), list):
        raise Refused(400, 'expected {"instances": [row, ...]} with one JSON object per row')
    rows = payload["instances"]
    _check_count(len(rows), max_rows)
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise Refused(400, f"instances[{i}] is {_type(row)}, not an object of the schema's columns")
        for c in columns:
            if c.name not in row:
                raise Refused(400, f"instances[{i}] has no column {c.name} (null for a missing value)")
    return pa.table({c.name: column_array(c, [r[c.name] for r in rows], "column") for c in columns})


def rows_v2(payload: Any, columns: list[Column], max_rows: int) -> Any:
    """Open Inference Protocol v2 ``inputs``: one tensor per column, shape ``[N]``."""
    import pyarrow as pa

    if not isinstance(payload, dict) or not isinstance(payload.get("inputs"), list):
        raise Refused(400, 'expected {"inputs": [{"name", "shape", "datatype", "data"}, ...]}')
    given: dict[str, Any] = {}
    for k, t in enumerate(payload["inputs"]):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise Refused(400, f"inputs[{k}] is not a tensor with a name")
        given[t["name"]] = t
    n: Optional[int] = None
    arrays = {}
    for c in columns:
        t = given.get(c.name)
        if t is None:
            raise Refused(400, f"no input named {c.name} (every column of the schema is needed; BYTES '' for missing)")
        shape, data, dtype = t.get("shape"), t.get("data"), t.get("datatype")
        if dtype not in V2_TYPES:
            raise Refused(400, f"input {c.name}: datatype {str(dtype)[:20]!r} is not one of {', '.join(V2_TYPES)}")
        if (not isinstance(shape, list) or len(shape) != 1 or isinstance(shape[0], bool)
                or not isinstance(shape[0], int) or shape[0] < 0):  # fmt: skip
            raise Refused(400, f"input {c.name}: shape must be [N], got {str(shape)[:40]}")
        _check_count(shape[0], max_rows)
        if not isinstance(data, list) or len(data) != shape[0]:
            raise Refused(400, f"input {c.name}: data must be a flat list of {shape[0]} values (its shape)")
        if n is not None and shape[0] != n:
            raise Refused(400, f"input {c.name}: shape [{shape[0]}], another input has [{n}]")
        n = shape[0]
        kind = V2_TYPES[dtype]
        for i, v in enumerate(data):
            ok = v is None or (isinstance(v, str) if kind == "text" else isinstance(v, int) and not isinstance(v, bool)
                               if kind == "int" else isinstance(v, (int, float)) and not isinstance(v, bool))  # fmt: skip
            if not ok:
                raise Refused(400, f"input {c.name}: row {i}: {_type(v)} in a {dtype} tensor")
        if c.kind == IDS and kind != "text":
            raise Refused(400, f"input {c.name}: a list column is sent as BYTES, its ids joined by {c.separator!r}")
        arrays[c.name] = column_array(c, data, "input")
    return pa.table(arrays)


def _check_count(n: int, max_rows: int) -> None:
    if n == 0:
        raise Refused(400, "the request has no rows")
    if n > max_rows:
        raise Refused(413, f"{n} rows: over the limit of {max_rows} a request (--max_request_rows)")


# -- the server ------------------------------------------------------------------------------


class Metrics:
    """The server's Prometheus metrics, in a registry of its own (``/metrics``)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.requests = Counter("torchrec_serve_requests", "Requests answered, by endpoint and HTTP code",
                                ["endpoint", "code"], registry=r)  # fmt: skip
        self.errors = Counter("torchrec_serve_errors", "Requests answered with a 4xx or 5xx, by code", ["code"], registry=r)
        self.latency = Histogram("torchrec_serve_request_seconds", "Inference request latency, seconds", ["endpoint"],
                                 registry=r, buckets=(.0005, .001, .002, .005, .01, .02, .05, .1, .2, .5, 1, 2, 5, 10))  # fmt: skip
        self.batch_rows = Histogram("torchrec_serve_batch_rows", "Rows per scored batch", registry=r,
                                    buckets=tuple(2.0**k for k in range(15)))  # fmt: skip
        self.queue_depth = Gauge("torchrec_serve_queue_depth", "Requests waiting to be batched", registry=r)
        # The name the rendered KEDA ScaledObject queries (deploy/serving.py, INFLIGHT_METRIC).
        self.in_flight = Gauge("torchrec_cloud_serve_inflight_requests", "Inference requests being handled", registry=r)
        self.version = Gauge("torchrec_serve_model_version", "1 for the model version being served", ["version"], registry=r)
        self.refused = Counter("torchrec_serve_versions_refused", "Model versions refused (failed their checks)", registry=r)
        self.swaps = Counter("torchrec_serve_version_swaps", "Model versions swapped in while serving", registry=r)


class State:
    """What the endpoints read: the model served (swapped whole), readiness, the batcher."""

    def __init__(self, ns: argparse.Namespace, model: Any, metrics: Metrics) -> None:
        from torchrec_cloud.serving.batcher import Batcher

        self.ns, self.model, self.metrics = ns, model, metrics
        self.name = ns.name
        self.loaded = False
        self.draining = False
        self.draining_since = 0.0  # set by the signal handler itself, before anything else
        self.failed: Optional[str] = None
        self.batcher = Batcher(lambda: self.model, ns.max_batch_size, ns.max_delay_ms / 1000, ns.max_queue,
                               on_batch=metrics.batch_rows.observe, on_depth=metrics.queue_depth.set)  # fmt: skip

    @property
    def ready(self) -> bool:
        return self.loaded and not self.draining and not self.draining_since

    def swap(self, model: Any) -> None:
        old = self.model
        self.model = model  # the batcher reads it once per batch
        self.metrics.version.remove(old.version)
        self.metrics.version.labels(model.version).set(1)
        self.metrics.swaps.inc()
        log(f"serving {self.name} version {model.version} (was {old.version})")

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


def log(line: str) -> None:
    print(f"torchrec-cloud serve: {line}", file=sys.stderr, flush=True)


def _error(status: int, message: str, retry_after: bool = False) -> Any:
    from starlette.responses import JSONResponse

    headers = {"Retry-After": "1"} if retry_after else None
    return JSONResponse({"error": " ".join(message.split())}, status_code=status, headers=headers)


def build_app(state: State) -> Any:
    """The Starlette application: the v2 and v1 endpoints, /metrics, and the access log."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
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

    async def read_body(request: Any) -> bytes:
        cap = ns.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > cap:
            raise Refused(413, f"the body has {declared} bytes: over the limit of {cap} (--max_body_bytes)")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > cap:
                raise Refused(413, f"the body is over the limit of {cap} bytes (--max_body_bytes)")
            chunks.append(chunk)
        return b"".join(chunks)

    async def infer(request: Any, protocol: str) -> Any:
        known(request)
        if not state.loaded:
            raise Refused(503, f"model {state.name} is not loaded yet", retry_after=True)
        body = await read_body(request)
        try:
            payload = json.loads(body)
        except (ValueError, RecursionError) as e:
            raise Refused(400, f"the body is not JSON ({str(e)[:120]})") from None
        columns = state.model.columns  # the same for every version (a swap checks it)
        parse = rows_v1 if protocol == "v1" else rows_v2
        table = parse(payload, columns, ns.max_request_rows)
        request.scope["torchrec_serve"]["rows"] = table.num_rows
        loop = asyncio.get_running_loop()
        answer = loop.create_future()

        def settle(result: Any, model: Any) -> None:
            if not answer.done():
                answer.set_result((result, model))

        item = state.batcher.submit(table, table.num_rows, lambda r, m: loop.call_soon_threadsafe(settle, r, m))
        if item is None:
            raise Refused(503, f"the queue is full ({ns.max_queue} requests, --max_queue): retry", retry_after=True)
        try:
            result, model = await asyncio.wait_for(asyncio.shield(answer), ns.timeout_s)
        except asyncio.TimeoutError:
            state.batcher.cancel(item)
            raise Refused(504, f"not scored within {ns.timeout_s:g}s (--timeout_s)") from None
        request.scope["torchrec_serve"]["version"] = model.version
        if isinstance(result, RequestError):
            raise Refused(400, str(result))
        if isinstance(result, Exception):
            log(f"scoring failed: {type(result).__name__}: {' '.join(str(result).split())[:300]}")
            raise Refused(500, f"scoring failed ({type(result).__name__}); the server log says more")
        probabilities = [float(p) for p in result]
        headers = {"X-Model-Version": model.version}
        if protocol == "v1":
            return JSONResponse({"predictions": probabilities}, headers=headers)
        out = {"model_name": state.name, "model_version": model.version,
               "outputs": [{"name": "probability", "shape": [len(probabilities)], "datatype": "FP64", "data": probabilities}]}  # fmt: skip
        if isinstance(payload.get("id"), str):
            out["id"] = payload["id"][:256]
        return JSONResponse(out, headers=headers)

    async def v1_predict(request: Any) -> Any:
        return await infer(request, "v1")

    async def v2_infer(request: Any) -> Any:
        return await infer(request, "v2")

    async def v1_model(request: Any) -> Any:
        known(request)
        return JSONResponse({"name": state.name, "ready": state.ready})

    async def prometheus(request: Any) -> Any:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def guarded(handler: Any, endpoint: str) -> Any:
        async def run(request: Any) -> Any:
            scope = request.scope.setdefault("torchrec_serve", {})
            scope["endpoint"] = endpoint
            inference = endpoint in ("v1", "v2")
            if inference:
                metrics.in_flight.inc()
            try:
                return await handler(request)
            except Refused as e:
                return _error(e.status, str(e), e.retry_after)
            except Exception as e:  # noqa: BLE001 - a fault of ours: one line, never a traceback to the client
                log(f"{request.method} {request.url.path}: {type(e).__name__}: {' '.join(str(e).split())[:300]}")
                return _error(500, f"internal error ({type(e).__name__})")
            finally:
                if inference:
                    metrics.in_flight.dec()

        return run

    routes = [
        Route("/v2/health/live", guarded(live, "live"), methods=["GET"]),
        Route("/v2/health/ready", guarded(ready, "ready"), methods=["GET"]),
        Route("/v2", guarded(server_metadata, "metadata"), methods=["GET"]),
        Route("/v2/models/{name}", guarded(model_metadata, "metadata"), methods=["GET"]),
        Route("/v2/models/{name}/ready", guarded(model_ready, "ready"), methods=["GET"]),
        Route("/v2/models/{name}/infer", guarded(v2_infer, "v2"), methods=["POST"]),
        Route("/v1/models/{name}:predict", guarded(v1_predict, "v1"), methods=["POST"]),
        Route("/v1/models/{name}", guarded(v1_model, "metadata"), methods=["GET"]),
        Route("/metrics", guarded(prometheus, "metrics"), methods=["GET"]),
    ]
    return AccessLog(Starlette(routes=routes), metrics)


class AccessLog:
    """ASGI wrapper: one line per request on stderr (client, method, path, status, rows, model
    version, milliseconds) and the request counters and latency histogram."""

    def __init__(self, app: Any, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

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
            seconds = time.perf_counter() - start
            endpoint, code = info.get("endpoint", "other"), str(status[0])
            self.metrics.requests.labels(endpoint, code).inc()
            if status[0] >= 400:
                self.metrics.errors.labels(code).inc()
            if endpoint in ("v1", "v2"):
                self.metrics.latency.labels(endpoint).observe(seconds)
            client = scope.get("client") or ("-", 0)
            extra = f" rows={info['rows']}" if "rows" in info else ""
            extra += f" version={info['version']}" if "version" in info else ""
            path = scope.get("path", "")[:200].encode("unicode_escape").decode()
            print(f"access {client[0]}:{client[1]} {scope.get('method')} {path} {code}{extra} {seconds * 1000:.1f}ms",
                  file=sys.stderr, flush=True)  # fmt: skip


def serve(ns: argparse.Namespace) -> int:
    """Load the model in the background, answer requests until SIGTERM, then drain and return 0."""
    import uvicorn

    from torchrec_cloud.serving.versions import Follower, first_model, is_root

    model = first_model(ns.model, ns.runtime)  # a folder that is no model stops here, before listening
    metrics = Metrics()
    state = State(ns, model, metrics)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            # uvicorn re-raises the signal after its shutdown (exit status 143); a drained server exits 0.
            # Not ready at once; the rest in a thread: a signal handler that prints could interrupt a print.
            state.draining_since = state.draining_since or time.monotonic()
            threading.Thread(target=state.drain, name="drain").start()
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True

    config = uvicorn.Config(build_app(state), host=ns.host, port=ns.port, access_log=False, log_level="warning",
                            lifespan="off", timeout_graceful_shutdown=ns.grace_s, server_header=False)  # fmt: skip
    server = Server(config)

    def load() -> None:
        try:
            model.load()
        except Exception as e:  # noqa: BLE001 - a model that does not load ends the server, named
            state.failed = " ".join(str(e).split()) if isinstance(e, ServingError) else f"{type(e).__name__}: {e}"
            server.should_exit = True
            return
        metrics.version.labels(model.version).set(1)
        state.loaded = True
        log(f"ready: {state.name} version {model.version} on http://{ns.host}:{ns.port} "
            f"(/v1/models/{state.name}:predict, /v2/models/{state.name}/infer, /metrics)")  # fmt: skip
        if ns.follow:
            follower = Follower(ns.model, lambda: state.model, state.swap, state.refuse, ns.poll_s, ns.runtime)
            threading.Thread(target=follower.run, name="versions", daemon=True).start()

    ns.follow = is_root(ns.model)
    batcher = threading.Thread(target=state.batcher.run, name="batcher", daemon=True)
    batcher.start()
    threading.Thread(target=load, name="load", daemon=True).start()
    try:
        server.run()
    except SystemExit:  # uvicorn's answer to an address it cannot bind (it logged why)
        raise ServingError(f"could not listen on {ns.host}:{ns.port} (in use, or not an address of this host)") from None
    finally:
        state.batcher.stop()
        batcher.join(timeout=ns.grace_s)
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
    parser.add_argument("--max_delay_ms", type=float, default=2.0,
                        help="how long the first request of a batch waits for others to join it")  # fmt: skip
    parser.add_argument("--max_queue", type=int, default=256, help="requests waiting at most; then 503 at once")
    parser.add_argument("--timeout_s", type=float, default=30.0, help="a request not scored by then is answered 504")
    parser.add_argument("--max_body_bytes", type=int, default=16 << 20, help="a larger request body is answered 413")
    parser.add_argument("--max_request_rows", type=int, default=8192, help="more rows in one request are answered 413")
    parser.add_argument("--poll_s", type=float, default=10.0, help="a published root: how often to read ROOT/current")
    parser.add_argument("--runtime", choices=("auto", "pt2", "torchscript"), default="auto",
                        help="auto: the model folder's AOTInductor package (scorer.pt2) when this torch built it, "
                             "else its TorchScript (scorer.pt)")  # fmt: skip
    parser.add_argument("--grace_s", type=float, default=25.0,
                        help="on SIGTERM, how long queued and in-flight requests have to finish")  # fmt: skip
    return parser


def _main(ns: argparse.Namespace) -> int:
    import re

    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", ns.name):
        raise ConfigError("name", f"must be letters, digits, '_', '.', '-' (at most 64), got {ns.name[:70]!r}")
    if not 0 <= ns.port <= 65535:
        raise ConfigError("port", f"must be 0..65535, got {ns.port}")
    for flag in ("max_batch_size", "max_queue", "max_body_bytes", "max_request_rows"):
        if getattr(ns, flag) <= 0:
            raise ConfigError(flag, f"must be > 0, got {getattr(ns, flag)}")
    for flag in ("max_delay_ms", "timeout_s", "poll_s", "grace_s"):
        value = getattr(ns, flag)
        if not (math.isfinite(value) and value >= 0) or (flag != "max_delay_ms" and value == 0):
            raise ConfigError(flag, f"must be a finite number {'>= 0' if flag == 'max_delay_ms' else '> 0'}, got {value}")
    return serve(ns)
