"""`torchrec-cloud serve`: real server processes on 127.0.0.1, real HTTP clients (urllib).

Two small models are trained and exported once for the module (events from data/events_gen.py
with string ids, lists and missing prices; a Criteo TSV). The tests check what a client
notices: v1 and v2 answers equal `predict --input` on the same rows; bad requests get one
JSON line naming the column or limit; a full queue answers 503 at once; SIGTERM answers what
was accepted and exits 0; a published version is swapped in under load with every answer from
exactly one version; a broken version is refused while the old one serves.

Nothing here waits on the clock to decide an outcome: the queue is held full by a batch that
cannot fill (--max_delay_ms far beyond the test), and each wait polls for a state the server
reports (its /metrics, its log) with a generous limit.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers import PYTHON, REPO, env_for_subprocess, explain, free_port, run
from torchrec_cloud.cli import main
from torchrec_cloud.data.criteo_gen import write_criteo_tsv
from torchrec_cloud.data.events_gen import DAY_S, SCHEMA, START, write_events

MODEL = ["--embedding_dim", "8", "--dense_arch_layer_sizes", "16,8", "--over_arch_layer_sizes", "16,1",
         "--batch_size", "100", "--no-progress", "--no-tensorboard", "--eval_every", "0"]  # fmt: skip
COLUMNS = ["user", "item", "tags", "recent", "price", "views"]


def train_and_export(root: Path, data: Path, *exports: tuple[str, str]) -> None:
    proc = run([PYTHON, "-m", "torchrec_cloud", "train", "--dataset_path", str(data), *MODEL, "--checkpoint_path",
                str(root / "ck"), "--checkpoint_interval", "3", "--output_dir", str(root / "run")])  # fmt: skip
    assert proc.returncode == 0, explain(proc)
    for step, out in exports:
        checkpoint = root / "ck" if step == "last" else next((root / "ck").glob(f"step_*{step}"))
        assert main(["export", str(checkpoint), "--output", str(root / out)]) == 0


@pytest.fixture(scope="module")
def events(tmp_path_factory):
    """Events preprocessed (day 0 trains, 1 validates, 2 tests), trained on one process with a
    checkpoint every 3 steps; the last exported to ``model``, step 3 to ``model_step3``."""
    root = tmp_path_factory.mktemp("serve_events")
    write_events(str(root / "events"), days=3, rows_per_day=600, seed=0)
    (root / "schema.yaml").write_text(SCHEMA)
    assert main(["data", "preprocess", "--no_progress", "--schema", str(root / "schema.yaml"), "--input",
                 str(root / "events"), "--output", str(root / "data"), "--split_by", "ts",
                 "--val_from", str(START + DAY_S), "--test_from", str(START + 2 * DAY_S)]) == 0  # fmt: skip
    train_and_export(root, root / "data", ("last", "model"), ("3", "model_step3"))
    return root


@pytest.fixture(scope="module")
def criteo(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_criteo")
    write_criteo_tsv(str(root / "train.txt"), rows=1500, seed=0, vocab=40)
    assert main(["data", "preprocess", "--no_progress", "--format", "kaggle", "--input", str(root / "train.txt"),
                 "--output", str(root / "data"), "--num_embeddings", "500"]) == 0  # fmt: skip
    train_and_export(root, root / "data", ("last", "model"))
    return root


class Server:
    """``torchrec-cloud serve`` in a process of its own; its stderr (access log) in a file."""

    def __init__(self, model: Path | str, tmp: Path, *flags: str, env: dict | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"serve_{self.port}.log"
        self._err = open(self.log, "w")
        self.proc = subprocess.Popen([PYTHON, "-m", "torchrec_cloud", "serve", str(model), "--name", "m", "--host",
                                      "127.0.0.1", "--port", str(self.port), *flags],
                                     env={**env_for_subprocess(), **(env or {})}, stdout=subprocess.DEVNULL,
                                     stderr=self._err)  # fmt: skip
        self.wait_for(lambda: get(self.url + "/v2/health/ready")[0] == 200, "ready")

    def wait_for(self, condition, what: str, limit: float = 180) -> None:
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"the server exited {self.proc.returncode} waiting for {what}:\n{self.text()[-3000:]}")
            try:
                if condition():
                    return
            except OSError:
                pass
            time.sleep(0.05)
        pytest.fail(f"no {what} within {limit}s:\n{self.text()[-3000:]}")

    def metric(self, name: str) -> float:
        status, body = get(self.url + "/metrics")
        lines = [line for line in body.splitlines() if line.startswith(name + " ") or line.startswith(name + "{")]
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines)

    def text(self) -> str:
        if not self._err.closed:
            self._err.flush()
        return self.log.read_text()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout=120)
        self._err.close()
        return rc


def request(url: str, body=None, method: str = "POST", raw: bytes | None = None):
    """(status, headers, parsed JSON or text) of one request on a new connection."""
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            status, headers, text = r.status, r.headers, r.read().decode()
    except urllib.error.HTTPError as e:
        status, headers, text = e.code, e.headers, e.read().decode()
    headers = {k.lower(): v for k, v in headers.items()}
    try:
        return status, headers, json.loads(text)
    except ValueError:
        return status, headers, text


def get(url: str):
    status, _, body = request(url, method="GET")
    return status, body


def predicted(model: Path, rows: Path, tmp: Path) -> list[float]:
    out = tmp / f"{model.name}_{rows.stem}.csv"
    assert main(["predict", str(model), "--input", str(rows), "--output", str(out), "--no_progress"]) == 0
    with open(out) as f:
        return [float(r["probability"]) for r in csv.DictReader(f)]


def v1_rows(table) -> list[dict]:
    return table.to_pylist()  # every column, the label and the time among them (ignored)


def v2_inputs(table) -> list[dict]:
    """One tensor per column: ids and counts as numbers, lists as BYTES joined by '|', the price
    as BYTES text (a CSV cell; '' where missing)."""
    cols = table.to_pydict()
    n = table.num_rows
    return [
        {"name": "user", "shape": [n], "datatype": "BYTES", "data": cols["user"]},
        {"name": "item", "shape": [n], "datatype": "INT64", "data": cols["item"]},
        {"name": "tags", "shape": [n], "datatype": "BYTES", "data": ["|".join(t) for t in cols["tags"]]},
        {"name": "recent", "shape": [n], "datatype": "BYTES", "data": ["|".join(map(str, r)) for r in cols["recent"]]},
        {"name": "price", "shape": [n], "datatype": "BYTES", "data": ["" if p is None else repr(p) for p in cols["price"]]},
        {"name": "views", "shape": [n], "datatype": "INT64", "data": cols["views"]},
        {"name": "clicked", "shape": [n], "datatype": "INT64", "data": cols["clicked"]},
    ]


@pytest.fixture(scope="module")
def served(events, tmp_path_factory):
    """One server of the events model with small limits, for the scoring and bad-input tests."""
    server = Server(events / "model", tmp_path_factory.mktemp("served"), "--max_body_bytes", "200000",
                    "--max_request_rows", "300")  # fmt: skip
    yield server
    assert server.stop() == 0, server.text()[-3000:]


def test_v1_and_v2_answers_equal_predict_on_parquet_rows(events, served, tmp_path):
    day = events / "events" / "day_2.parquet"
    table = pq.read_table(day)
    assert table.column("price").null_count > 0 and any(len(t) == 0 for t in table.column("tags").to_pylist())
    expected = predicted(events / "model", day, tmp_path)
    assert len(expected) == table.num_rows == 600
    v1, v2 = [], []
    for lo in range(0, table.num_rows, 200):
        part = table.slice(lo, 200)
        status, headers, body = request(served.url + "/v1/models/m:predict", {"instances": v1_rows(part)})
        assert status == 200, body
        v1 += body["predictions"]
        status, _, body = request(served.url + "/v2/models/m/infer", {"id": "r1", "inputs": v2_inputs(part)})
        assert status == 200, body
        assert body["id"] == "r1" and body["model_version"] == "model"
        [out] = body["outputs"]
        assert out["shape"] == [part.num_rows]
        v2 += out["data"]
    assert v1 == pytest.approx(expected, abs=1e-6)
    assert v2 == pytest.approx(expected, abs=1e-6)
    # An unseen user and tag score as predict scores them (the out-of-vocabulary rows).
    row = dict(v1_rows(table.slice(0, 1))[0], user="someone-new", tags=["never-seen"])
    status, _, body = request(served.url + "/v1/models/m:predict", {"instances": [row]})
    pq.write_table(pa.Table.from_pylist([row], schema=table.schema), tmp_path / "new.parquet")
    assert status == 200, body
    assert body["predictions"] == pytest.approx(predicted(events / "model", tmp_path / "new.parquet", tmp_path), abs=1e-6)
    # A row of missing values only (null in every column): scored as predict scores it.
    empty = {k: None for k in row if k != "clicked"}  # predict scores rows without the label too
    status, _, body = request(served.url + "/v1/models/m:predict", {"instances": [empty]})
    unlabelled = table.schema.remove(table.schema.get_field_index("clicked"))
    pq.write_table(pa.Table.from_pylist([empty], schema=unlabelled), tmp_path / "empty.parquet")
    assert status == 200, body
    assert body["predictions"] == pytest.approx(predicted(events / "model", tmp_path / "empty.parquet", tmp_path), abs=1e-6)
    status, meta = get(served.url + "/v2/models/m")
    assert status == 200 and meta["versions"] == ["model"]
    assert sorted(i["name"] for i in meta["inputs"]) == sorted(COLUMNS)


def test_a_criteo_model_takes_raw_criteo_fields(criteo, tmp_path):
    lines = (criteo / "train.txt").read_text().splitlines()[:40]
    (tmp_path / "rows.txt").write_text("\n".join(lines) + "\n")
    expected = predicted(criteo / "model", tmp_path / "rows.txt", tmp_path)
    rows = []
    for line in lines:
        fields = line.split("\t")
        row = {f"int_{i}": int(v) if v else None for i, v in enumerate(fields[1:14])}
        row.update({f"cat_{i}": v or None for i, v in enumerate(fields[14:])})
        rows.append(dict(row, label=int(fields[0])))
    assert any(v is None for r in rows for v in r.values())  # missing fields among them
    server = Server(criteo / "model", tmp_path)
    try:
        status, _, body = request(server.url + "/v1/models/m:predict", {"instances": rows})
        assert status == 200, body
        assert body["predictions"] == pytest.approx(expected, abs=1e-6)
        inputs = [{"name": name, "shape": [len(rows)], "datatype": "BYTES",
                   "data": ["" if r[name] is None else str(r[name]) for r in rows]} for name in rows[0]]  # fmt: skip
        status, _, body = request(server.url + "/v2/models/m/infer", {"inputs": inputs})
        assert status == 200, body
        assert body["outputs"][0]["data"] == pytest.approx(expected, abs=1e-6)
        # The request docs/serving.md sends with curl, as written.
        example = (REPO / "examples" / "serve" / "criteo_rows.json").read_bytes()
        status, _, body = request(server.url + "/v1/models/m:predict", raw=example)
        assert status == 200 and len(body["predictions"]) == 2 and all(0 < p < 1 for p in body["predictions"]), body
        status, _, body = request(server.url + "/v1/models/m:predict", {"instances": [dict(rows[0], cat_3="xyz\t1")]})
        assert status == 400 and "cat_3" in body["error"], body
        # Serving needs neither TorchRec nor fbgemm (seconds of a replica's start): not loaded.
        maps = Path(f"/proc/{server.proc.pid}/maps")
        assert not maps.exists() or "fbgemm" not in maps.read_text()
    finally:
        assert server.stop() == 0


def test_bad_requests_get_one_json_line_naming_the_column_or_limit(events, served):
    row = v1_rows(pq.read_table(events / "events" / "day_2.parquet").slice(0, 1))[0]
    url = served.url + "/v1/models/m:predict"
    # The module's server answered other tests' requests before: what this one adds is counted.
    v1_before = served.metric('torchrec_serve_request_seconds_count{endpoint="v1"}')
    cases = [
        (request(url, raw=b'{"instances": [{"user": '), 400, "not JSON"),
        (request(url, {"rows": [row]}), 400, "instances"),
        (request(url, {"instances": [dict(row, user={"id": 1})]}), 400, "user"),
        (request(url, {"instances": [dict(row, views=True)]}), 400, "views"),
        (request(url, {"instances": [dict(row, item="not-an-id")]}), 400, "item"),
        (request(url, {"instances": [dict(row, price="cheap")]}), 400, "price"),
        (request(url, {"instances": [{k: v for k, v in row.items() if k != "tags"}]}), 400, "tags"),
        (request(url, {"instances": [row] * 301}), 413, "--max_request_rows"),
        (request(url, raw=b'{"instances": [' + b" " * 200_001 + b"]}"), 413, "--max_body_bytes"),
        (request(url, {"instances": []}), 400, "no rows"),
        (request(served.url + "/v1/models/other:predict", {"instances": [row]}), 404, "other"),
        (request(url, method="GET"), 405, "POST"),
        (request(served.url + "/v2/models/m/infer", {"inputs": [{"name": c, "shape": [1], "datatype": "FP16",
                                                                 "data": [1]} for c in COLUMNS]}), 400, "FP16"),  # fmt: skip
        (request(served.url + "/v2/models/m/infer", {"inputs": v2_inputs(pq.read_table(events / "events" / "day_2.parquet")
                                                                         .slice(0, 2))[1:]}), 400, "user"),  # fmt: skip
        (request(served.url + "/v2/models/m/infer", {"inputs": [dict(t, datatype="INT64", data=[1, 2]) if t["name"] == "tags"
                 else t for t in v2_inputs(pq.read_table(events / "events" / "day_2.parquet").slice(0, 2))]}), 400, "BYTES"),  # fmt: skip
    ]
    for (status, headers, body), code, named in cases:
        assert status == code, (code, named, body)
        assert isinstance(body, dict) and set(body) == {"error"} and named in body["error"], (named, body)
        assert "\n" not in body["error"] and "Traceback" not in body["error"]
    assert request(url, {"instances": [row]})[0] == 200  # still serving
    assert "Traceback" not in served.text()
    assert served.metric("torchrec_serve_errors_total") >= len(cases)
    assert served.metric('torchrec_serve_requests_total{code="413",endpoint="v1"}') == 2
    assert served.metric("torchrec_serve_batch_rows_count") > 0 and served.metric("torchrec_serve_batch_rows_sum") > 0
    # Every request to the v1 path is timed, refused or not: the cases but the last three (v2's), and the good one.
    assert served.metric('torchrec_serve_request_seconds_count{endpoint="v1"}') - v1_before == len(cases) - 3 + 1
    assert served.metric("torchrec_cloud_serve_inflight_requests") == 0 and served.metric("torchrec_serve_queue_depth") == 0
    assert served.metric('torchrec_serve_model_version{version="model"}') == 1
    access = [line for line in served.text().splitlines() if line.startswith("access ")]
    assert any(" POST /v1/models/m:predict 413 " in line for line in access), access[-5:]


def test_a_one_row_request_takes_the_forms_its_columns_take_alone():
    """rows_v1 decides a one-row request's forms at a glance; they must be column_form's (the
    forms decide which requests are converted together, so a wrong one would mix types)."""
    from torchrec_cloud.serving.model import CRITEO_HEX, CRITEO_INT, ID, IDS, NUMBER, Column
    from torchrec_cloud.serving.requests import Refused, column_form, rows_v1

    values = [None, "", "7", "a1", 3, -2, 2.5, float("nan"), True, [1, 2], ["a", 3], [], {"x": 1}]
    for kind in (NUMBER, ID, IDS, CRITEO_INT, CRITEO_HEX):
        c = Column("x", kind)
        for v in values:
            answers = []
            for decide in (lambda: column_form(c, [v], "column"), lambda: rows_v1({"instances": [{"x": v}]}, [c], 10).forms[0]):
                try:
                    answers.append(decide())
                except Refused as e:
                    answers.append(f"{e.status} {e}")
            assert answers[0] == answers[1], (kind, v, answers)


def test_a_full_queue_answers_503_at_once_and_sigterm_answers_what_it_holds(events, tmp_path):
    """A batch that can never fill (256 rows, a wait longer than the test) holds the two
    requests the queue has room for; the third is refused at once. SIGTERM then scores the
    two, answers them and exits 0."""
    rows = v1_rows(pq.read_table(events / "events" / "day_2.parquet").slice(0, 2))
    server = Server(events / "model", tmp_path, "--max_queue", "2", "--max_delay_ms", "3600000", "--timeout_s", "3600")
    answers: list = []
    clients = [threading.Thread(target=lambda r=r: answers.append(request(server.url + "/v1/models/m:predict",
                                                                          {"instances": [r]}))) for r in rows]  # fmt: skip
    for c in clients:
        c.start()
    try:
        server.wait_for(lambda: server.metric("torchrec_serve_queue_depth") == 2, "two queued requests")
        status, headers, body = request(server.url + "/v2/models/m/infer",
                                        {"inputs": v2_inputs(pq.read_table(events / "events" / "day_2.parquet").slice(0, 1))})  # fmt: skip
        assert status == 503 and headers.get("retry-after") == "1" and "--max_queue" in body["error"], body
        # Shed before the body is read: headers announcing a body that never comes get their 503.
        head = headers_only_answer(server.port, b"POST /v1/models/m:predict HTTP/1.1\r\nHost: t\r\n"
                                                b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n")  # fmt: skip
        assert head.startswith("HTTP/1.1 503 ") and "\r\nretry-after: 1\r\n" in head.lower(), head
        assert "--max_queue" in head.split("\r\n\r\n", 1)[1], head
        assert not answers  # the two are still held
    finally:
        rc = server.stop()
    assert rc == 0, server.text()[-3000:]
    for c in clients:
        c.join(timeout=60)
    assert sorted(a[0] for a in answers) == [200, 200], answers
    expected = predicted(events / "model", events / "events" / "day_2.parquet", tmp_path)[:2]
    assert sorted(a[2]["predictions"][0] for a in answers) == pytest.approx(sorted(expected), abs=1e-6)
    assert "SIGTERM: not ready; answering 2 queued request(s)" in server.text()


def http_request(path: str, body: bytes = b"", method: str = "POST", version: str = "1.1", headers: str = "",
                 length: int | None = None) -> bytes:  # fmt: skip
    """One request's bytes; ``length``: the Content-Length declared (the body's own by default)."""
    if method == "POST" and "chunked" not in headers:
        headers = f"Content-Length: {len(body) if length is None else length}\r\n{headers}"
    return f"{method} {path} HTTP/{version}\r\nHost: x\r\n{headers}\r\n".encode() + body


def read_answers(sock: socket.socket, count: int) -> list[tuple[int, dict, bytes]]:
    """``count`` answers read off one connection, in order: (status, headers, body)."""
    data, answers = b"", []
    while len(answers) < count:
        if b"\r\n\r\n" in data:
            head, rest = data.split(b"\r\n\r\n", 1)
            lines = head.decode().split("\r\n")
            if lines[0].endswith("100 Continue"):
                answers.append((100, {}, b""))
                data = rest
                continue
            headers = dict(line.lower().split(": ", 1) for line in lines[1:])
            size = int(headers["content-length"])
            if len(rest) >= size:
                answers.append((int(lines[0].split()[1]), headers, rest[:size]))
                data = rest[size:]
                continue
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection after {len(answers)} of {count} answers"
        data += chunk
    assert not data, data
    return answers


def test_the_inference_endpoints_speak_http_as_uvicorn_does(events, served):
    """The inference endpoints are answered below uvicorn's ASGI layer (serving.inference_http):
    what a client does with HTTP/1.1 still works there. Pipelined requests on one connection are
    answered in order, mixing both ways of answering (a query string goes the ASGI way, the
    health check is Starlette's) with a chunked body and a refusal among them; a client that
    waits for ``100 Continue`` gets it before sending its body, or a 413 without it when its
    declared body is over the cap; HTTP/1.0 gets its answer and the connection closed; a
    client that hangs up halfway through its body leaves no request in flight."""
    rows = v1_rows(pq.read_table(events / "events" / "day_2.parquet").slice(0, 3))
    bodies = [json.dumps({"instances": [r]}).encode() for r in rows]
    alone = [request(served.url + "/v1/models/m:predict", {"instances": [r]})[2]["predictions"] for r in rows]
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (bodies[1][:10], bodies[1][10:])) + b"0\r\n\r\n"
    with socket.create_connection(("127.0.0.1", served.port), timeout=60) as s:
        s.sendall(http_request("/v1/models/m:predict", bodies[0]) + http_request("/v1/models/other:predict", bodies[0])
                  + http_request("/v2/health/live", method="GET")
                  + http_request("/v1/models/m:predict", chunked, headers="Transfer-Encoding: chunked\r\n")
                  + http_request("/v1/models/m:predict?trace=1", bodies[2]))  # fmt: skip
        answers = read_answers(s, 5)
    assert [a[0] for a in answers] == [200, 404, 200, 200, 200], answers
    assert [json.loads(answers[k][2])["predictions"] for k in (0, 3, 4)] == alone
    assert answers[0][1]["x-model-version"] == "model" and answers[0][1]["content-type"] == "application/json"
    assert "date" in answers[0][1] and "other" in json.loads(answers[1][2])["error"]

    with socket.create_connection(("127.0.0.1", served.port), timeout=60) as s:
        s.sendall(http_request("/v1/models/m:predict", headers="Expect: 100-continue\r\n", length=len(bodies[0])))
        assert read_answers(s, 1)[0][0] == 100
        s.sendall(bodies[0])
        status, _, body = read_answers(s, 1)[0]
        assert status == 200 and json.loads(body)["predictions"] == alone[0]
        s.sendall(http_request("/v1/models/m:predict", headers="Expect: 100-continue\r\n", length=999_999_999))
        status, _, body = read_answers(s, 1)[0]  # no 100 Continue first
        assert status == 413 and "--max_body_bytes" in json.loads(body)["error"], body

    with socket.create_connection(("127.0.0.1", served.port), timeout=60) as s:
        s.sendall(http_request("/v1/models/m:predict", bodies[0], version="1.0"))
        status, headers, body = read_answers(s, 1)[0]
        assert status == 200 and headers["connection"] == "close" and s.recv(1) == b""

    def given_up() -> int:
        return served.text().count(" POST /v1/models/m:predict 400 ")

    before = given_up()
    with socket.create_connection(("127.0.0.1", served.port), timeout=60) as s:
        s.sendall(http_request("/v1/models/m:predict", bodies[0][:10], length=500))
        served.wait_for(lambda: served.metric("torchrec_cloud_serve_inflight_requests") == 1, "the request in flight")
    served.wait_for(lambda: given_up() == before + 1, "the given-up request in the access log")
    served.wait_for(lambda: served.metric("torchrec_cloud_serve_inflight_requests") == 0, "nothing in flight")
    assert request(served.url + "/v1/models/m:predict", {"instances": [rows[0]]})[2]["predictions"] == alone[0]


def test_answered_requests_leave_nothing_for_the_cyclic_collector(events, tmp_path):
    """What a request makes is freed as soon as it is answered (no reference cycle among its
    objects): Python's cyclic collector, whose pauses hold up every request on the event loop,
    finds nothing to collect after 2,000 one-row requests from 8 clients (the process's
    python_gc_* in /metrics, beside its process_* figures); a cycle a request would cost
    thousands. A server of its own: what other tests' refusals left behind is not counted."""
    rows = v1_rows(pq.read_table(events / "events" / "day_2.parquet").slice(0, 8))
    server = Server(events / "model", tmp_path)

    def collected() -> float:
        _, text = get(server.url + "/metrics")
        assert server.metric("process_resident_memory_bytes") > 0
        return sum(map(float, re.findall(r"^python_gc_objects_collected_total\{.*\} (\S+)$", text, re.M)))

    statuses: list[int] = []

    def client(row: dict) -> None:
        body = http_request("/v1/models/m:predict", json.dumps({"instances": [row]}).encode())
        with socket.create_connection(("127.0.0.1", server.port), timeout=60) as s:
            for _ in range(250):
                s.sendall(body)
                statuses.append(read_answers(s, 1)[0][0])

    try:
        before = collected()
        threads = [threading.Thread(target=client, args=(row,)) for row in rows]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        found = collected() - before
    finally:
        assert server.stop() == 0, server.text()[-3000:]
    assert statuses == [200] * 2000
    assert found < 100, f"the cyclic collector found {found:.0f} objects of answered requests"


def test_a_turn_of_requests_is_scored_together_and_the_queue_holds_max_queue(events):
    """--max_delay_ms 0 (the default): the requests submitted in one turn of the event loop are
    scored together after it, a batch of at most --max_batch_size rows a turn (the loop's I/O in
    between), each answered with its own rows' scores (as they score alone); past --max_queue,
    one more is refused."""
    import asyncio

    from torchrec_cloud.serving.batcher import TurnBatcher
    from torchrec_cloud.serving.model import ServedModel
    from torchrec_cloud.serving.requests import decode_v1

    model = ServedModel(str(events / "model"))
    model.load()
    rows = v1_rows(pq.read_table(events / "events" / "day_2.parquet").slice(0, 4))
    requests = [decode_v1(json.dumps({"instances": [r]}).encode(), model.columns, 10, model.plain)[1] for r in rows]
    alone = [model.predict([r])[0][0] for r in requests]
    batches, got = [], {}

    async def turn() -> list:
        batcher = TurnBatcher(lambda: model, max_batch_size=2, max_queue=3, on_batch=batches.append)
        items = [batcher.submit(r, 1, lambda result, m, k=k: got.__setitem__(k, result)) for k, r in enumerate(requests)]
        assert not got and batcher.full()  # nothing scored before the turn ends
        await asyncio.sleep(0)
        assert batches == [2] and sorted(got) == [0, 1]  # one batch a turn
        await asyncio.sleep(0)
        return items

    items = asyncio.run(turn())
    assert items[3] is None and all(items[:3])
    assert batches == [2, 1]
    assert [float(got[k][0]) for k in range(3)] == pytest.approx(alone[:3], abs=1e-6)


def test_criteo_rows_in_their_plain_form_convert_as_the_general_way_converts_them(criteo):
    """A Criteo model's v1 rows in their plain form are read field by field on the event loop
    (ServedModel.plain) to the records, ids and dense transform's shifts that the general way
    gives (each column checked, the rows written as TSV lines and parsed by parse_block, as
    predict reads a file), on edge values: int32's ends, signs, leading zeros, integers as
    text, missing fields, 15 hexadecimal digits in both cases, and batches of ids all 8 digits
    wide (Criteo's, read at once) or not; and values not in the plain form
    (a float, a boolean, an integer id, text that is no integer, an integer past int32, a
    missing column) are left to the general way, which names them or scores them as it does."""
    import numpy as np

    from torchrec_cloud.serving.model import CriteoRecords, ServedModel
    from torchrec_cloud.serving.requests import rows_v1

    model = ServedModel(str(criteo / "model"))
    ints = [None, 0, -1, 2147483647, -2147483647, "007", "", "12", 5, 65535, "-3", 1, "0"]
    cats = [None, "", "0", "f" * 15, "ABCDEF", "a1", "7fffffffffffffF", *["%x" % (k * 7919) for k in range(19)]]
    rows = []
    for k in range(5):  # rotated, so that each value meets several columns
        row = {f"int_{i}": ints[(i + k) % 13] for i in range(13)}
        row.update({f"cat_{i}": cats[(i + k) % 26] for i in range(26)})
        rows.append(row)
    # Criteo's own width: every id 8 digits (a missing one too), which a batch reads at once
    wide = [dict(row, **{f"cat_{i}": "%08x" % ((i + k + 1) * 2654435761 % 2**32) for i in range(26)}) for k, row in enumerate(rows)]
    wide[0].update(cat_3=None, cat_5="", cat_7="ABCDEF01", cat_8="00000000", cat_9="ffffffff")
    wide[4].update(cat_1="abcdef", cat_2="0123456789")  # a line of Criteo's length, its ids of other widths
    converter = model.converter
    for requests in ([rows[:2], rows[2:]], [rows[:1], rows[1:2], rows[2:5]], [rows * 4], [wide[:2], wide[2:4]],
                     [wide, rows[:1]], [wide[4:]]):  # fmt: skip
        plain = [model.plain(r) for r in requests]
        assert all(isinstance(p, CriteoRecords) for p in plain)
        general = [rows_v1({"instances": r}, model.columns, 100) for r in requests]
        assert not any(isinstance(g, CriteoRecords) for g in general)
        sizes = [len(r) for r in requests]
        records, shift = converter.convert_values(plain, sizes)
        checked, shift_checked = converter.convert_values(general, sizes)  # parse_block, after each column's check
        alone = [converter.convert(p.table(), [n]) for p, n in zip(plain, sizes)]  # how a failing request is named
        assert (records == checked).all() and (shift == shift_checked).all()
        assert (np.concatenate([a[0] for a in alone]) == records).all()
    for field, value in (("int_3", 1.5), ("int_3", True), ("int_3", "1e3"), ("int_3", " 12"), ("int_3", 2147483648),
                         ("int_3", -2147483648), ("cat_3", 17), ("cat_3", "0x1f"), ("cat_3", "1" * 16), ("cat_3", "a\tb"),
                         ("cat_3", ["a1"])):  # fmt: skip
        assert model.plain([dict(rows[0], **{field: value})]) is None, (field, value)
    assert model.plain([{k: v for k, v in rows[0].items() if k != "cat_9"}]) is None


def test_a_v1_answer_is_the_json_of_its_probabilities_and_a_nan_is_never_written():
    """A v1 answer (orjson writes it where installed) reads back as the probabilities json
    would write; a probability that is not a number is refused (json raises, the request is
    answered 500), never written as null as orjson would."""
    import math
    from types import SimpleNamespace

    import numpy as np

    from torchrec_cloud.serving.server import Inference

    model = SimpleNamespace(version="v1")
    scores = np.array([0.1, 1e-05, 0.999999999, 2.5e-300, 1.0, 0.0])
    status, body, headers = Inference.scored(None, "v1", {}, scores, model, {})
    assert status == 200 and json.loads(body) == {"predictions": scores.tolist()}
    for bad in (math.nan, math.inf):
        with pytest.raises(ValueError):
            Inference.scored(None, "v1", {}, np.array([0.5, bad]), model, {})


def headers_only_answer(port: int, request: bytes) -> str:
    """Send ``request`` (headers, no body) and read the answer: its head and body, as text."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < int(
                re.search(rb"(?i)content-length: *(\d+)", data).group(1)):  # fmt: skip
            chunk = s.recv(65536)  # a server waiting for the body never answers: socket.timeout
            if not chunk:
                break
            data += chunk
    return data.decode()


def test_a_request_not_scored_in_time_is_answered_504_and_leaves_the_queue(events, tmp_path):
    """With a batch that never fills, a request waits out --timeout_s: 504, and its place in
    the queue (one place here) is free again for the next one."""
    rows = v1_rows(pq.read_table(events / "events" / "day_2.parquet").slice(0, 1))
    server = Server(events / "model", tmp_path, "--max_queue", "1", "--max_delay_ms", "3600000", "--timeout_s", "0.5")
    try:
        for _ in range(2):
            status, _, body = request(server.url + "/v1/models/m:predict", {"instances": rows})
            assert status == 504 and "--timeout_s" in body["error"], body
        assert server.metric("torchrec_serve_queue_depth") == 0
    finally:
        assert server.stop() == 0, server.text()[-3000:]


def criteo_rows(path: Path, n: int) -> list[dict]:
    """The first ``n`` rows of a Criteo TSV as v1 rows (null where a field is empty)."""
    rows = []
    for line in path.read_text().splitlines()[:n]:
        fields = line.split("\t")
        row = {f"int_{i}": int(v) if v else None for i, v in enumerate(fields[1:14])}
        row.update({f"cat_{i}": v or None for i, v in enumerate(fields[14:])})
        rows.append(row)
    return rows


@pytest.mark.parametrize("which", ["events", "criteo"])
def test_requests_scored_in_one_batch_each_get_their_own_answer(which, events, criteo, tmp_path):
    """Five one-row requests held until the batch of five is full, so that they are converted
    and scored together: each good one scores as `predict` scores its row alone (for Criteo,
    a file of that row: the dense transform's minimum is the request's), and the ones with a
    value that does not convert are answered 400 naming its column, alone (for Criteo: one
    refused by its column's pattern, one that passes the patterns but not the parser: an
    integer out of int32's range, among the rows converted as TSV lines together)."""
    if which == "events":
        model, table = events / "model", pq.read_table(events / "events" / "day_2.parquet").slice(0, 3)
        good = v1_rows(table)
        bad = [(dict(good[0], item="not-an-id"), "item"), (dict(good[1], price="cheap"), "price")]
        files = []
        for i in range(3):
            pq.write_table(table.slice(i, 1), tmp_path / f"row{i}.parquet")
            files.append(tmp_path / f"row{i}.parquet")
    else:
        model, good = criteo / "model", criteo_rows(criteo / "train.txt", 3)
        bad = [(dict(good[0], cat_3="xyz"), "cat_3"), (dict(good[1], int_0=9999999999), "int_0")]
        lines = (criteo / "train.txt").read_text().splitlines()
        files = []
        for i in range(3):
            (tmp_path / f"row{i}.txt").write_text(lines[i] + "\n")
            files.append(tmp_path / f"row{i}.txt")
    expected = [predicted(model, f, tmp_path)[0] for f in files]
    server = Server(model, tmp_path, "--max_batch_size", "5", "--max_delay_ms", "3600000", "--timeout_s", "3600")
    answers: dict = {}
    clients = [threading.Thread(target=lambda k=k, r=r: answers.__setitem__(k, request(server.url + "/v1/models/m:predict",
                                                                                      {"instances": [r]})))
               for k, r in enumerate([*good, *(row for row, _ in bad)])]  # fmt: skip
    try:
        for c in clients:
            c.start()
        for c in clients:
            c.join(timeout=300)
        assert server.metric("torchrec_serve_batch_rows_count") == 1  # one batch of the five
        assert server.metric("torchrec_serve_batch_rows_sum") == 5
    finally:
        assert server.stop() == 0, server.text()[-3000:]
    for k in range(3):
        status, _, body = answers[k]
        assert status == 200, body
        assert body["predictions"] == pytest.approx([expected[k]], abs=1e-6)
    for k, (_, column) in enumerate(bad, start=3):
        status, _, body = answers[k]
        assert status == 400 and column in body["error"] and "row 0" in body["error"], body


@pytest.mark.parametrize("workers,batcher", [(1, "thread"), (2, "thread"), (1, "turn"), (2, "turn")])
def test_sigterm_under_load_answers_every_accepted_request_and_exits_0(events, tmp_path, workers, batcher):
    """Six clients. With a batcher thread whose batches wait for ever to fill: one server,
    batches of 4: at any time at least two requests are queued, so SIGTERM always finds some;
    two workers (each its batcher), batches of 2: a worker holds at most one request that waits
    (the next fills its batch), so the clients never all wait, and SIGTERM (to the parent) is
    sent once a request is queued. With the default batches of a loop turn, SIGTERM comes
    while the clients keep sending. Every request the server accepted (its access log) is
    answered 200 to its client; the others were never accepted (the listener closed: a
    connection error); the exit status is 0."""
    rows = v1_rows(pq.read_table(events / "events" / "day_2.parquet").slice(0, 6))
    batch, queued = (4, 2) if workers == 1 else (2, 1)
    flags = ["--max_batch_size", str(batch), "--max_delay_ms", "3600000", "--timeout_s", "3600"] if batcher == "thread" else []
    server = Server(events / "model", tmp_path, *flags, "--workers", str(workers))
    got: list[int] = []
    errors: list[str] = []
    stop = threading.Event()

    def client(row: dict) -> None:
        while not stop.is_set():
            try:
                status, _, body = request(server.url + "/v1/models/m:predict", {"instances": [row]})
            except OSError as e:  # refused or closed before it was read: not accepted
                errors.append(type(e).__name__)
                return
            got.append(status)

    threads = [threading.Thread(target=client, args=(r,)) for r in rows]
    for t in threads:
        t.start()
    server.wait_for(lambda: got.count(200) >= 12, "a few answered batches")
    if batcher == "thread":
        server.wait_for(lambda: server.metric("torchrec_serve_queue_depth") >= queued, "queued requests")
    rc = server.stop()
    stop.set()
    for t in threads:
        t.join(timeout=60)
    log = server.text()
    assert rc == 0, log[-3000:]
    assert set(got) == {200}, got
    accepted = sum(1 for line in log.splitlines() if line.startswith("access ") and ":predict 200" in line)
    assert accepted == len(got), (accepted, len(got), errors)
    assert log.count("SIGTERM: not ready; answering") == workers and "Traceback" not in log


def publish(root: Path, model: Path, version: str, damage=None) -> None:
    """What `export --publish ROOT` does: the version folder (``damage`` done to it, before
    ``current`` names it), then ``current`` replaced atomically."""
    shutil.copytree(model, root / version)
    if damage is not None:
        damage(root / version)
    tmp = root / f".current.{version}"
    tmp.write_text(version + "\n")
    os.replace(tmp, root / "current")


@pytest.mark.parametrize("workers", [1, 2])
def test_versions_swap_under_load_and_a_broken_one_is_refused(events, criteo, tmp_path, workers):
    """A published root under four clients: v2 swapped in with no failed request and every
    answer all from one version; a damaged v3 and a v4 of other columns refused while v2
    serves. With two workers each follows ``current`` and swaps on its own; the counts of one
    scrape are the server's (each worker swaps and refuses once)."""
    root = tmp_path / "published"
    root.mkdir()
    publish(root, events / "model", "v1")
    rows_file = tmp_path / "rows.parquet"
    pq.write_table(pq.read_table(events / "events" / "day_2.parquet").slice(0, 5), rows_file)
    expected = {"v1": predicted(events / "model", rows_file, tmp_path),
                "v2": predicted(events / "model_step3", rows_file, tmp_path)}  # fmt: skip
    assert max(abs(a - b) for a, b in zip(expected["v1"], expected["v2"])) > 1e-4  # the versions differ
    body = {"instances": v1_rows(pq.read_table(rows_file))}
    server = Server(root, tmp_path, "--poll_s", "0.1", "--workers", str(workers))
    answers: list = []
    failures: list = []
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            try:
                status, headers, got = request(server.url + "/v1/models/m:predict", body)
            except OSError as e:
                failures.append(repr(e))
                continue
            (answers if status == 200 else failures).append((headers.get("x-model-version"), got))

    threads = [threading.Thread(target=client) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        server.wait_for(lambda: len(answers) >= 10, "answers from v1")
        publish(root, events / "model_step3", "v2")
        server.wait_for(lambda: get(server.url + "/v2/models/m")[1]["versions"] == ["v2"], "v2 swapped in")
        server.wait_for(lambda: server.metric("torchrec_serve_version_swaps_total") == workers, "v2 in every worker")
        seen = len(answers)
        server.wait_for(lambda: len(answers) >= seen + 10, "answers from v2")
        # A damaged version and one with other columns: refused, v2 keeps serving.
        def cut_short(folder: Path) -> None:  # every scorer file of the version, whichever runtime loads
            for name in ("scorer.pt", "scorer.pt2"):
                if (folder / name).exists():
                    (folder / name).write_bytes((folder / name).read_bytes()[:1000])

        publish(root, events / "model", "v3", damage=cut_short)
        server.wait_for(lambda: server.text().count("refused version v3") == workers, "v3 refused")
        publish(root, criteo / "model", "v4")
        server.wait_for(lambda: server.text().count("refused version v4") == workers, "v4 refused")
        seen = len(answers)
        server.wait_for(lambda: len(answers) >= seen + 10, "answers after the refusals")
        assert get(server.url + "/v2/models/m")[1]["versions"] == ["v2"]
        server.wait_for(lambda: server.metric("torchrec_serve_versions_refused_total") == 2 * workers,
                        "v3 and v4 refused by every worker")  # fmt: skip
        assert server.metric("torchrec_serve_version_swaps_total") == workers
        assert server.metric('torchrec_serve_model_version{version="v2"}') == 1
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
        rc = server.stop()
    log = server.text()
    assert rc == 0 and not failures, (failures[:3], log[-3000:])
    versions = [v for v, _ in answers]
    assert set(versions) == {"v1", "v2"} and versions.index("v2") > 0
    for version, got in answers:  # every answer all from one version
        assert got["predictions"] == pytest.approx(expected[version], abs=1e-6), version
    refused = [line for line in log.splitlines() if "refused version" in line]
    assert len(refused) == 2 * workers and all("still serving v2" in line for line in refused), refused
    assert all("scorer.pt" in line for line in refused if "version v3" in line), refused  # scorer.pt or scorer.pt2
    assert all("columns" in line for line in refused if "version v4" in line), refused


def test_a_published_root_in_a_bucket_is_served_and_followed(events, s3_service, monkeypatch, tmp_path):
    """MODEL as a bucket URL (storage.py): a published root on the S3 emulator, its versions
    read from there, a new ``current`` followed."""
    from torchrec_cloud import storage

    for key, value in s3_service.env.items():
        monkeypatch.setenv(key, value)
    root = f"{s3_service.url}/published"
    for version, model in (("v1", events / "model"), ("v2", events / "model_step3")):
        for f in model.rglob("*"):
            if f.is_file():
                storage.write_bytes(storage.join(root, version, *f.relative_to(model).parts), f.read_bytes())
    storage.write_bytes(storage.join(root, "current"), b"v1\n")
    rows_file = tmp_path / "rows.parquet"
    pq.write_table(pq.read_table(events / "events" / "day_2.parquet").slice(0, 3), rows_file)
    body = {"instances": v1_rows(pq.read_table(rows_file))}
    server = Server(root, tmp_path, "--poll_s", "0.2", env=s3_service.env)
    try:
        status, headers, got = request(server.url + "/v1/models/m:predict", body)
        assert status == 200 and headers["x-model-version"] == "v1", got
        assert got["predictions"] == pytest.approx(predicted(events / "model", rows_file, tmp_path), abs=1e-6)
        storage.write_bytes(storage.join(root, "current"), b"v2\n")
        server.wait_for(lambda: get(server.url + "/v2/models/m")[1]["versions"] == ["v2"], "v2 from the bucket")
        status, headers, got = request(server.url + "/v1/models/m:predict", body)
        assert status == 200 and headers["x-model-version"] == "v2", got
        assert got["predictions"] == pytest.approx(predicted(events / "model_step3", rows_file, tmp_path), abs=1e-6)
    finally:
        assert server.stop() == 0, server.text()[-3000:]


@pytest.mark.parametrize("current", [None, "../model\n", "/etc\n", "missing\n"])
def test_what_is_no_model_is_refused_before_listening(tmp_path, capsys, current):
    """A folder that holds no model, or a root whose ``current`` names a folder outside it or
    none: one line, exit 1, nothing served."""
    root = tmp_path / "root"
    root.mkdir()
    if current is not None:
        (root / "current").write_text(current)
    capsys.readouterr()
    rc = main(["serve", str(root), "--port", str(free_port())])
    err = capsys.readouterr().err
    assert rc == 1 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    if current is None:
        assert "not a model directory" in err, err
    elif current == "missing\n":
        assert "missing" in err and "model_config.json" in err, err
    else:
        assert "not a name inside its folder" in err, err


# -- --workers N ---------------------------------------------------------------------------------


def worker_pids(server: Server) -> list[int]:
    """The server's worker processes: its parent's children."""
    pid = server.proc.pid
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def mapping_of(pid: int, path: Path) -> dict[str, int]:
    """The sizes (kB) /proc/PID/smaps gives the mappings of ``path`` in that process, summed."""
    fields: dict[str, int] = {}
    inside = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):
            inside = line.endswith(" " + str(path))
            continue
        key, _, value = line.partition(":")
        if inside and value.strip().endswith(" kB"):
            fields[key] = fields.get(key, 0) + int(value.split()[0])
    return fields


def answered(server: Server, endpoint: str, code: str = "200") -> float:
    """``torchrec_serve_requests_total`` of one endpoint and code, from one scrape."""
    _, body = get(server.url + "/metrics")
    pattern = re.compile(r"torchrec_serve_requests_total\{(.*)\} (\S+)")
    total = 0.0
    for m in map(pattern.fullmatch, body.splitlines()):
        if m and f'endpoint="{endpoint}"' in m.group(1) and f'code="{code}"' in m.group(1):
            total += float(m.group(2))
    return total


def test_two_workers_answer_as_predict_share_the_mapped_tables_and_one_scrape_counts_both(events, tmp_path):
    """``--workers 2``: both workers map the model folder's tables.pt, its pages shared (the
    page cache holds one copy); one-row v1 and v2 requests from eight clients, until each worker
    has answered some (the access log names it), all equal `predict`; one scrape of /metrics
    counts the requests of both; a worker killed is reported and replaced while the other
    answers, and SIGTERM to the parent then exits 0."""
    model = events / "model"
    rows_file = tmp_path / "rows.parquet"
    table = pq.read_table(events / "events" / "day_2.parquet").slice(0, 24)
    pq.write_table(table, rows_file)
    expected = predicted(model, rows_file, tmp_path)
    v1 = v1_rows(table)
    server = Server(model, tmp_path, "--workers", "2", "--runtime", "torchscript")
    try:
        pids = worker_pids(server)
        assert len(pids) == 2, pids
        for pid in pids:
            mapped = mapping_of(pid, model / "tables.pt")
            assert mapped.get("Rss", 0) > 0, f"worker {pid} does not map tables.pt: {mapped}"
            assert mapped["Shared_Clean"] > 0 or mapped["Pss"] < mapped["Rss"], mapped
        got: list = []
        failures: list = []

        def client(k: int) -> None:
            for i in range(k, len(v1), 8):
                status, _, body = request(server.url + "/v1/models/m:predict", {"instances": [v1[i]]})
                if status != 200:
                    failures.append(body)
                    continue
                got.append(("v1", i, body["predictions"][0]))
                status, _, body = request(server.url + "/v2/models/m/infer", {"inputs": v2_inputs(table.slice(i, 1))})
                if status != 200:
                    failures.append(body)
                    continue
                got.append(("v2", i, body["outputs"][0]["data"][0]))

        def both_answered() -> bool:
            threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            scored = [line for line in server.text().splitlines() if line.startswith("access ") and " 200 rows=" in line]
            return all(any(line.endswith(f" worker={w}") for line in scored) for w in (0, 1))

        server.wait_for(both_answered, "answers from both workers")
        assert not failures, failures[:3]
        for protocol, i, p in got:
            assert p == pytest.approx(expected[i], abs=1e-6), (protocol, i)
        # A request is counted just after its answer is sent: wait for the last ones, then scrape
        # a few times (each scrape reaches either worker) and find the same whole-server count.
        server.wait_for(lambda: answered(server, "v1") + answered(server, "v2") >= len(got), "every answer counted")
        counts = [(answered(server, "v1"), answered(server, "v2")) for _ in range(4)]
        assert counts == [(len(got) / 2, len(got) / 2)] * 4, (counts, len(got))

        os.kill(pids[0], signal.SIGKILL)
        server.wait_for(lambda: "died (signal 9): starting another" in server.text(), "the death reported")
        assert get(server.url + "/v2/health/ready")[0] == 200  # the other worker answers meanwhile
        server.wait_for(lambda: len(set(worker_pids(server)) - set(pids)) == 1, "a replacement worker")
        server.wait_for(lambda: server.text().count("[worker 0]: ready") == 2, "the replacement loaded")
        status, _, body = request(server.url + "/v1/models/m:predict", {"instances": v1[:3]})
        assert status == 200 and body["predictions"] == pytest.approx(expected[:3], abs=1e-6), body
    finally:
        rc = server.stop()
    log = server.text()
    assert rc == 0 and "Traceback" not in log, log[-3000:]


def test_a_tables_file_that_is_not_the_scorers_is_refused(events, tmp_path):
    """tables.pt is read as untrusted input: mapped in place of the TorchScript scorer's tables
    when it is theirs (same scores); refused, naming the file, when truncated, when it holds
    more than tensors, tables of another shape, or is a link."""
    import torch

    from torchrec_cloud.serving import ServingError, read_model_config
    from torchrec_cloud.serving.runtime import load_scorer

    features = read_model_config(str(events / "model"))["features"]
    g = torch.Generator().manual_seed(0)
    dense = torch.rand(3, features["dense"], generator=g)
    lengths = torch.ones(3 * len(features["sparse"]), dtype=torch.int64)
    plain = load_scorer(str(events / "model"), "torchscript")
    mapped = load_scorer(str(events / "model"), "torchscript", map_tables=True)
    assert plain.mapped is None and mapped.mapped == str(events / "model" / "tables.pt")
    values = torch.zeros(len(lengths), dtype=torch.int64)
    assert torch.equal(mapped.logits_of_bags(dense, values, lengths), plain.logits_of_bags(dense, values, lengths))

    def damaged(name: str, damage) -> str:
        folder = tmp_path / name
        shutil.copytree(events / "model", folder)
        damage(folder / "tables.pt")
        config = json.loads((folder / "model_config.json").read_text())
        if name != "truncated":  # the record follows the file: only its content is wrong
            config["files"]["tables.pt"] = (folder / "tables.pt").stat().st_size
        (folder / "model_config.json").write_text(json.dumps(config))
        with pytest.raises(ServingError) as e:
            load_scorer(str(folder), "torchscript", map_tables=True)
        assert "tables.pt" in str(e.value) and "\n" not in str(e.value), e.value
        return str(e.value)

    def shorter_table(path: Path) -> None:
        tables = torch.load(path, weights_only=True)
        torch.save({**tables, "weight": tables["weight"][:-1].clone()}, path)

    def link(path: Path) -> None:
        path.rename(path.with_name("elsewhere.pt"))
        path.symlink_to(path.with_name("elsewhere.pt"))

    assert "truncated" in damaged("truncated", lambda p: p.write_bytes(p.read_bytes()[:-1]))
    assert "not a loadable tables file" in damaged("code", lambda p: torch.save({"weight": print}, p))
    assert "the scorer's" in damaged("shape", shorter_table)
    assert "cannot open" in damaged("link", link)


def test_tables_from_a_bucket_are_one_local_file_that_every_loader_of_the_version_maps(events, s3_service, monkeypatch, tmp_path):
    """A model folder in a bucket: its tables.pt is copied once to a local file named by its
    digest in a private folder, which each loader (each worker) maps; scores as the scorer's
    own tables; the copies of older versions beyond the one before are removed."""
    import tempfile

    import torch

    from torchrec_cloud import storage
    from torchrec_cloud.serving import read_model_config
    from torchrec_cloud.serving.runtime import load_scorer

    for key, value in s3_service.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    root = f"{s3_service.url}/mapped-{tmp_path.name}"
    for version, model in (("v1", events / "model"), ("v2", events / "model_step3")):
        for f in model.rglob("*"):
            if f.is_file():
                storage.write_bytes(storage.join(root, version, *f.relative_to(model).parts), f.read_bytes())
    features = read_model_config(str(events / "model"))["features"]
    g = torch.Generator().manual_seed(0)
    dense = torch.rand(3, features["dense"], generator=g)
    lengths = torch.ones(3 * len(features["sparse"]), dtype=torch.int64)
    values = torch.zeros(len(lengths), dtype=torch.int64)
    first, second = (load_scorer(f"{root}/v1", "torchscript", map_tables=True) for _ in range(2))
    copies = tmp_path / f"torchrec-cloud-tables-{os.getuid()}"
    assert first.mapped == second.mapped and Path(first.mapped).parent == copies, (first.mapped, second.mapped)
    assert Path(first.mapped).read_bytes() == (events / "model" / "tables.pt").read_bytes()
    assert copies.stat().st_mode & 0o077 == 0
    plain = load_scorer(f"{root}/v1", "torchscript")
    assert plain.mapped is None
    assert torch.equal(first.logits_of_bags(dense, values, lengths), plain.logits_of_bags(dense, values, lengths))

    newer = load_scorer(f"{root}/v2", "torchscript", map_tables=True)
    assert newer.mapped != first.mapped and sorted(p.name for p in copies.iterdir()) == sorted(
        Path(p).name for p in (first.mapped, newer.mapped))
    # A third version's copy (here: an older folder's tables written as one): the oldest goes.
    third = copies / ("0" * 64 + ".pt")
    third.write_bytes(b"x")
    os.utime(first.mapped, (1, 1))
    load_scorer(f"{root}/v2", "torchscript", map_tables=True)
    assert sorted(p.name for p in copies.iterdir()) == sorted([Path(newer.mapped).name, third.name])
    # A folder of the same name that is not private (another user could have made it): not
    # used; the tables stay in the process, with a note.
    copies.chmod(0o755)
    assert load_scorer(f"{root}/v2", "torchscript", map_tables=True).mapped is None


def test_workers_below_one_are_refused_naming_the_flag(tmp_path, capsys):
    capsys.readouterr()
    rc = main(["serve", str(tmp_path), "--workers", "0", "--port", str(free_port())])
    err = capsys.readouterr().err
    assert rc == 2 and "--workers" in err and len(err.strip().splitlines()) == 1, err


def test_a_worker_that_cannot_load_its_model_ends_the_server(events, tmp_path):
    """A model whose scorer is damaged (model_config.json still reads): each worker fails to
    load it and says why; the parent stops and exits 1, never restarting them."""
    folder = tmp_path / "damaged"
    shutil.copytree(events / "model", folder)
    (folder / "scorer.pt").write_bytes((folder / "scorer.pt").read_bytes()[:1000])
    proc = subprocess.run([PYTHON, "-m", "torchrec_cloud", "serve", str(folder), "--host", "127.0.0.1", "--port",
                           str(free_port()), "--workers", "2", "--runtime", "torchscript"],
                          env=env_for_subprocess(), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 1, explain(proc)
    assert "before its model was loaded" in proc.stderr and "scorer.pt" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "starting another" not in proc.stderr, proc.stderr[-3000:]


def test_without_the_compiled_extras_the_server_answers_the_same(events, served, tmp_path):
    """uvloop, httptools and orjson are optional (the serve extra installs them): where they do
    not import, the server runs on asyncio's own loop and h11, answers every request the ASGI
    way (serving.server.Inference, no answers below it) and decodes with json, says so in its
    ready line, and answers as the served one does, refusals included; concurrent requests
    each get one whole access-log line (they are written a loop turn's lines at a time)."""
    blocked = tmp_path / "no_extras"
    for name in ("uvloop", "httptools", "orjson"):
        (blocked / name).mkdir(parents=True)
        (blocked / name / "__init__.py").write_text(f'raise ImportError("{name} is not installed here")\n')
    path = f"{blocked}{os.pathsep}{env_for_subprocess()['PYTHONPATH']}"
    rows = v1_rows(pq.read_table(events / "events" / "day_2.parquet").slice(0, 16))
    server = Server(events / "model", tmp_path, "--max_body_bytes", "200000", "--max_request_rows", "300",
                    env={"PYTHONPATH": path})  # fmt: skip
    answers: dict[str, list] = {"served": [None] * 16, "asyncio": [None] * 16}

    def client(i: int) -> None:
        for which, url in (("asyncio", server.url), ("served", served.url)):
            status, _, body = request(url + "/v1/models/m:predict", {"instances": [rows[i]]})
            answers[which][i] = body["predictions"][0] if status == 200 else body

    bad = [{"instances": [dict(rows[0], price="cheap")]}, {"instances": [rows[0]] * 301}, {"rows": []}]
    try:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for body in bad:
            assert request(server.url + "/v1/models/m:predict", body)[::2] == request(served.url + "/v1/models/m:predict", body)[::2]
    finally:
        assert server.stop() == 0, server.text()[-3000:]
    assert answers["asyncio"] == pytest.approx(answers["served"], abs=1e-6), answers
    log = server.text()
    assert "HTTP parser h11, event loop asyncio" in log, log[-2000:]
    assert ("event loop uvloop" in served.text()) == (importlib.util.find_spec("uvloop") is not None)
    line = r"access 127\.0\.0\.1:\d+ POST /v1/models/m:predict 200 rows=1 version=model \d+\.\d\dms"
    assert len(re.findall(rf"^{line}$", log, re.M)) == 16, log[-3000:]
