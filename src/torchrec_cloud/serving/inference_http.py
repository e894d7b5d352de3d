"""The two inference endpoints answered on uvicorn's connections below its ASGI layer.

``POST /v1/models/NAME:predict`` and ``POST /v2/models/NAME/infer`` are most of what a server
answers, and for a one-row request the ASGI machinery around them (a task, two coroutines,
the scope and message dicts, the header checks) costs as much as the request's own JSON and
checks. So :class:`InferenceProtocol`, uvicorn's httptools protocol with three parser callbacks
taken over, answers those two from the parsed request directly: the body gathered as it
arrives, the rows queued, the answer written when the batcher's result reaches the loop. Its
steps are :class:`~torchrec_cloud.serving.server.Inference`'s own (``admit``, ``parse``,
``submit``, ``scored``), so both ways answer the same; every other request (the rest of the API,
and these paths with a query, percent-escapes or another method) goes the ASGI way as before.

What uvicorn's own code does with a connection's request keeps working, because a
:class:`Call` has the attributes uvicorn reads of its request cycle (uvicorn 0.54.0,
``uvicorn/protocols/http/httptools_impl.py``): ``response_complete`` and ``keep_alive`` (its
graceful shutdown closes idle connections and lets busy ones finish their answer with
``connection: close``, and waits for them: a request in flight is answered before the server
exits), ``disconnected`` and ``message_event`` (``connection_lost``), and pipelined requests wait
in the connection's ``pipeline`` until the answer before them is written.
"""

from __future__ import annotations

import re
import time
from typing import Any, Optional

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from torchrec_cloud.serving.requests import Refused

# The paths answered here: a name of serve's own characters (serve.py checks --name), no query,
# no escapes; anything else goes the ASGI way (where, for instance, another name gets its 404).
PATHS = re.compile(rb"/v1/models/([A-Za-z0-9_.-]+):predict|/v2/models/([A-Za-z0-9_.-]+)/infer")

_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class _NoEvent:
    """What uvicorn's ``connection_lost`` sets on a request cycle; a Call waits on nothing."""

    def set(self) -> None:
        pass


_NO_EVENT = _NoEvent()


def protocol_class(inference: Any) -> type:
    """uvicorn's httptools protocol answering the inference endpoints with ``inference``
    (:class:`~torchrec_cloud.serving.server.Inference`)."""

    class InferenceProtocol(HttpToolsProtocol):
        def on_headers_complete(self) -> None:
            match = PATHS.fullmatch(self.url) if self.parser.get_method() == b"POST" else None
            if match is None or self.parser.should_upgrade():
                return super().on_headers_complete()
            version = self.parser.get_http_version()
            call = Call(self, inference, match, version != "1.0" and self.parser.should_keep_alive())
            previous, self.cycle = self.cycle, call
            if previous is None or previous.response_complete:
                call.start()
            else:  # pipelined: answered after the requests before it (uvicorn's order)
                self.flow.pause_reading()
                self.pipeline.appendleft((call, None))

        def _start_asgi_task(self, cycle: Any, app: Any) -> None:
            if cycle.__class__ is Call:  # a pipelined Call's turn
                cycle.start()
            else:
                super()._start_asgi_task(cycle, app)

        def on_body(self, body: bytes) -> None:
            if self.cycle.__class__ is Call:
                self.cycle.feed(body)
            else:
                super().on_body(body)

        def on_message_complete(self) -> None:
            if self.cycle.__class__ is Call:
                self.cycle.end_of_body()
            else:
                super().on_message_complete()

        def connection_lost(self, exc: Optional[Exception]) -> None:
            cycle = self.cycle
            super().connection_lost(exc)
            if cycle.__class__ is Call:
                cycle.lost()

    return InferenceProtocol


class Call:
    """One request to an inference endpoint, from its headers to its answer, on the loop."""

    __slots__ = ("conn", "inference", "protocol", "name", "path", "declared", "expect_continue", "keep_alive",
                 "response_complete", "disconnected", "message_event", "chunks", "size", "body_done", "started",
                 "queued", "item", "timer", "payload", "info", "start_time")  # fmt: skip

    def __init__(self, conn: Any, inference: Any, match: re.Match, keep_alive: bool) -> None:
        self.conn, self.inference, self.keep_alive = conn, inference, keep_alive
        v1 = match.group(1)
        self.protocol, self.name = ("v1", v1.decode()) if v1 is not None else ("v2", match.group(2).decode())
        # Read now: by its turn (a pipelined request), the connection's headers are the next one's.
        self.path, self.declared = conn.url.decode(), b""
        for k, v in conn.headers:
            if k == b"content-length":
                self.declared = v
        self.expect_continue = conn.expect_100_continue
        self.response_complete = self.disconnected = self.body_done = self.started = self.queued = False
        self.message_event = _NO_EVENT
        self.chunks: list[bytes] = []
        self.size = 0
        self.item = self.timer = self.payload = None
        self.info: dict = {"endpoint": self.protocol}
        self.start_time = 0.0

    def start(self) -> None:
        """Its turn on the connection: admitted (or answered at once), then its body is awaited."""
        self.started, self.start_time = True, time.perf_counter()
        self.inference.gauges.flight(1)
        try:
            early = self.inference.admit(self.name, self.declared)
        except Refused as e:
            return self.refuse(e)
        except Exception as e:  # noqa: BLE001 - a fault of ours: one line, never a traceback to the client
            return self.fail(e)
        if early is not None:
            return self.respond(*early)
        if self.expect_continue and not self.conn.transport.is_closing():
            self.conn.transport.write(_CONTINUE)  # what uvicorn writes when an app reads the body
        if self.body_done:
            self.run()

    def feed(self, data: bytes) -> None:
        if self.response_complete:  # answered before its body (a refusal): the rest is read past
            return
        self.size += len(data)
        if self.size > self.inference.state.ns.max_body_bytes:
            cap = self.inference.state.ns.max_body_bytes
            return self.refuse(Refused(413, f"the body is over the limit of {cap} bytes (--max_body_bytes)"))
        self.chunks.append(data)

    def end_of_body(self) -> None:
        self.body_done = True
        if self.started and not self.response_complete:
            self.run()

    def run(self) -> None:
        body = self.chunks[0] if len(self.chunks) == 1 else b"".join(self.chunks)
        self.chunks = []
        inference = self.inference
        try:
            self.payload, rows = inference.parse(self.protocol, body, self.info)
            self.item = inference.submit(rows, self.scored, self.conn.loop)
            if self.item is None:
                return self.respond(503, inference.queue_full, [(b"retry-after", b"1")])
            self.queued = True
            self.timer = self.conn.loop.call_later(inference.state.ns.timeout_s, self.timed_out)
        except Refused as e:
            self.refuse(e)
        except Exception as e:  # noqa: BLE001 - a fault of ours: one line, never a traceback to the client
            self.fail(e)

    def scored(self, value: tuple[Any, Any]) -> None:
        if self.response_complete:  # answered 504 meanwhile
            return
        try:  # respond cancels the timer, whichever answer it writes
            self.respond(*self.inference.scored(self.protocol, self.payload, value[0], value[1], self.info))
        except Refused as e:
            self.refuse(e)
        except Exception as e:  # noqa: BLE001
            self.fail(e)

    def timed_out(self) -> None:
        if not self.response_complete:
            self.refuse(self.inference.timed_out(self.item))

    def lost(self) -> None:
        """The client closed the connection: a request still sending its body is given up
        (as the ASGI way answers it, for the access log and the metrics); a queued one is
        scored and its answer dropped."""
        if self.started and not self.response_complete and not self.queued:
            self.refuse(Refused(400, "the client closed the connection before sending its whole body"))

    def refuse(self, e: Refused) -> None:
        self.respond(*self.inference.refusal(e))

    def fail(self, e: Exception) -> None:
        self.respond(*self.inference.failure(f"POST {self.path}", e))

    def respond(self, status: int, body: bytes, headers: list) -> None:
        """Write the answer (unless the client has gone), then what uvicorn does after one."""
        self.response_complete = True
        conn, inference = self.conn, self.inference
        # The queued item's callback is this call's bound method: a cycle, which only the cyclic
        # collector would free, and each of its pauses holds up every request on the loop.
        if self.timer is not None:
            self.timer.cancel()
        self.item = self.timer = self.payload = None
        inference.gauges.flight(-1)
        # uvicorn marks only the connection's latest request disconnected: an earlier pipelined
        # one learns it from the transport.
        if not self.disconnected and not conn.transport.is_closing():
            out = [STATUS_LINE[status]]
            for name, value in conn.server_state.default_headers:  # the date
                out += [name, b": ", value, b"\r\n"]
            for name, value in headers:
                out += [name, b": ", value, b"\r\n"]
            out.append(b"content-type: application/json\r\ncontent-length: %d\r\n" % len(body))
            if not self.keep_alive:
                out.append(b"connection: close\r\n")
            out += [b"\r\n", body]
            conn.transport.write(b"".join(out))
            if not self.keep_alive:
                conn.transport.close()
        conn.on_response_complete()  # the next pipelined request, or the keep-alive timer
        scope = {"client": conn.client, "method": "POST", "path": self.path}
        inference.access.record(scope, self.info, status, time.perf_counter() - self.start_time)
