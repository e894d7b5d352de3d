"""What ``serve`` tells about itself: its Prometheus metrics (``/metrics``), the gauges of what
it holds, and the access log (one line a request on stderr). :mod:`.server` answers; this
module counts and writes."""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any, Optional


class Metrics:
    """The server's Prometheus metrics, in a registry of its own (``/metrics``). With
    ``--workers N`` they are in prometheus_client's multiprocess mode (:mod:`.workers`): each
    worker's values in files, which a scrape of any worker adds up (``scrape``); the gauges say
    how (``livesum``: the live workers' sum; ``livemax``: the model version any live worker serves)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        if self.multiprocess:
            from prometheus_client import values

            # Its values ask the kernel for the pid at every update, to notice a fork (getpid is a
            # system call): a worker is started by exec and never forks, so its pid is read once.
            pid = os.getpid()
            values.ValueClass = values.MultiProcessValue(process_identifier=lambda: pid)
        self.registry = r = CollectorRegistry()
        self.requests = Counter("torchrec_serve_requests", "Requests answered, by endpoint and HTTP code",
                                ["endpoint", "code"], registry=r)  # fmt: skip
        self.errors = Counter("torchrec_serve_errors", "Requests answered with a 4xx or 5xx, by code", ["code"], registry=r)
        self.latency = Histogram("torchrec_serve_request_seconds", "Inference request latency, seconds", ["endpoint"],
                                 registry=r, buckets=(.0005, .001, .002, .005, .01, .02, .05, .1, .2, .5, 1, 2, 5, 10))  # fmt: skip
        self.batch_rows = Histogram("torchrec_serve_batch_rows", "Rows per scored batch", registry=r,
                                    buckets=tuple(2.0**k for k in range(15)))  # fmt: skip
        self.queue_depth = Gauge("torchrec_serve_queue_depth", "Requests waiting to be batched", registry=r,
                                 multiprocess_mode="livesum")  # fmt: skip
        # The name the rendered KEDA ScaledObject queries (deploy/serving.py, INFLIGHT_METRIC).
        self.in_flight = Gauge("torchrec_cloud_serve_inflight_requests", "Inference requests being handled", registry=r,
                               multiprocess_mode="livesum")  # fmt: skip
        self.version = Gauge("torchrec_serve_model_version", "1 for the model version being served", ["version"],
                             registry=r, multiprocess_mode="livemax")  # fmt: skip
        self.refused = Counter("torchrec_serve_versions_refused", "Model versions refused (failed their checks)", registry=r)
        self.swaps = Counter("torchrec_serve_version_swaps", "Model versions swapped in while serving", registry=r)
        if not self.multiprocess:  # what prometheus_client's default registry has; one process's, never summed
            from prometheus_client import GCCollector, ProcessCollector

            GCCollector(registry=r)  # the cyclic collector's pauses hold up every request on the loop
            ProcessCollector(registry=r)

    def scrape(self) -> bytes:
        """The text of ``/metrics``: this process's registry, or every worker's values."""
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.multiprocess import MultiProcessCollector

        if not self.multiprocess:
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        return generate_latest(registry)


class LiveGauges:
    """The in-flight and queue-depth gauges, written at most once a turn of the event loop (a
    write takes a lock, and with ``--workers N`` writes a shared file): a scrape reads what
    the server held at the end of a turn. Every change of either happens on the loop: a
    request admitted or answered, queued, or given up (what the batcher takes from the queue
    is answered on the loop after it)."""

    def __init__(self, metrics: Metrics, depth: Any) -> None:
        self.metrics, self.depth = metrics, depth
        self.in_flight = 0
        self._scheduled = False

    def flight(self, delta: int) -> None:
        self.in_flight += delta
        self.changed()

    def changed(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self.publish)

    def publish(self) -> None:
        self._scheduled = False
        self.metrics.in_flight.set(self.in_flight)
        self.metrics.queue_depth.set(self.depth())


class Access:
    """One access-log line per request on stderr (client, method, path, status, rows, model
    version, milliseconds, and with ``--workers N`` the worker) and the request counters and
    latency histogram. The lines of one turn of the event loop go out in one write at its next
    turn (a write a request was most of a one-row request's cost in system calls), in pieces
    of whole lines no longer than a pipe writes at once, so the workers' lines never mix; the
    metrics' labelled children are looked up once, not at every request."""

    def __init__(self, metrics: Metrics, worker: Optional[int] = None) -> None:
        self.metrics = metrics
        self.worker = "" if worker is None else f" worker={worker}"  # --workers N: which one answered
        self._counters: dict[tuple[str, str], Any] = {}
        self._lines: list[str] = []

    def record(self, scope: Any, info: dict, status: int, seconds: float) -> None:
        endpoint, code = info.get("endpoint", "other"), str(status)
        counters = self._counters.get((endpoint, code))
        if counters is None:
            m = self.metrics
            counters = self._counters[endpoint, code] = (
                m.requests.labels(endpoint, code), m.errors.labels(code) if status >= 400 else None,
                m.latency.labels(endpoint) if endpoint in ("v1", "v2") else None)  # fmt: skip
        requests, errors, latency = counters
        requests.inc()
        if errors is not None:
            errors.inc()
        if latency is not None:
            latency.observe(seconds)
        client = scope.get("client") or ("-", 0)
        extra = f" rows={info['rows']}" if "rows" in info else ""
        extra += f" version={info['version']}" if "version" in info else ""
        path = scope.get("path", "")[:200].encode("unicode_escape").decode()
        if not self._lines:
            asyncio.get_running_loop().call_soon(self.flush)
        self._lines.append(f"access {client[0]}:{client[1]} {scope.get('method')} {path} {code}{extra} "
                           f"{seconds * 1000:.2f}ms{self.worker}\n")  # fmt: skip

    def flush(self) -> None:
        """Write the lines held (also called once the server has stopped)."""
        lines, self._lines = self._lines, []
        if lines:
            write_lines(lines)


_PIPE_BUF = 4096  # POSIX: a write of at most this many bytes to a pipe is never interleaved with another's


def write_lines(lines: list[str]) -> None:
    """Lines (each ending in a newline) on stderr, in as few writes as keep each whole."""
    sys.stderr.flush()  # what write_line wrote goes first
    chunk, size = [], 0
    for line in lines:
        data = line.encode("utf-8", "backslashreplace")
        if chunk and size + len(data) > _PIPE_BUF:
            _write_all(b"".join(chunk))
            chunk, size = [], 0
        chunk.append(data)
        size += len(data)
    _write_all(b"".join(chunk))


def _write_all(data: bytes) -> None:
    while data:
        data = data[os.write(2, data):]
