"""`serve` under load, against its limit, in one run (issue #40): a real load generator
(wrk, Debian's `wrk` package: `apt-get install wrk`) against `torchrec-cloud serve` on
127.0.0.1, beside offline `predict` of the same rows with the same model.

    python bench/serving_load.py                     # trains and exports a small model first
    python bench/serving_load.py --model models/q    # an exported Criteo-layout model folder
    python bench/serving_load.py --workers 2         # serve --workers 2: two processes on the port
    python bench/serving_load.py --server_cpus all   # the server and wrk on the same cores (no pinning)
    python bench/serving_load.py --max_delay_ms 2    # a batcher thread waiting up to 2 ms (default 0: none)

What it does: a Criteo-layout model (the quickstart's, 10,000 rows a table; or ``--model``),
exported as TorchScript and as an AOTInductor package; 4,096 generated raw Criteo rows;
``predict --input`` on them (the limit: rows/s of scoring the same rows offline, whole
batches, no HTTP; measured before the first run and again after every run, and each run set
against the mean of the measurements just before and just after it); then for each runtime
(``serve --runtime torchscript|pt2``), request size (1 and 64 rows, v1 ``instances``) and
number of clients (1, 16, 64 connections), ``wrk -d DURATION`` against
``/v1/models/NAME:predict``: rows/s, p50/p95/p99 latency, the answers that were not 200, and
the server's own CPU time per request (from /proc: on a shared machine, the figure other
processes distort least). Last, the shedding point: 256 connections of 64-row requests against
a server with ``--max_queue 8``: how many were shed (503) and how fast the server answered
them (its access log's times of the 503 lines). Prints one line per run and a Markdown table
for bench/RESULTS.md. Each run also gives the server's own p50/p99 (its access log: from a
request's headers to its answer written), apart from what wrk and the sockets add, and the
share of the server's CPUs' time that the hypervisor gave to other machines (steal).

Where the cores go: a load generator on the server's cores measures their sum, not the server
(a request's answer waits while wrk or another worker holds the core: on 2 cores, that was
most of p99 at 16 clients; bench/RESULTS.md). So by default the server, its workers and the
offline limit run on ``--server_cpus`` (the upper half of this process's CPUs, as ``taskset``
would pin them; ``serve --workers`` one per CPU unless given) and wrk on the rest, as a
replica with CPUs of its own and clients on other machines would run; the limit is then what
those same CPUs score offline. ``--server_cpus all``: no pinning, the server and wrk share
every core, wrk ahead of the server in the scheduler's queue where this user may ask for it
(``nice -n -10``; ``--wrk_same_priority``: not).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from torchrec_cloud.ports import free_port  # noqa: E402

# wrk's Lua: POST the body file; at the end one JSON line of the figures wrk measured.
WRK_SCRIPT = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local f = assert(io.open(os.getenv("BODY_FILE"), "rb"))
wrk.body = f:read("*a")
f:close()
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('WRK {"requests": %d, "seconds": %.6f, "p50_ms": %.3f, "p95_ms": %.3f, ' ..
    '"p99_ms": %.3f, "non_2xx": %d, "socket_errors": %d}\\n', summary.requests, summary.duration / 1e6,
    latency:percentile(50) / 1e3, latency:percentile(95) / 1e3, latency:percentile(99) / 1e3, e.status,
    e.connect + e.read + e.write + e.timeout))
end
"""


# The CPUs the server (and the offline limit) may run on, and wrk's; empty: every CPU, shared.
SERVER_CPUS: set[int] = set()
WRK_CPUS: set[int] = set()


def pinned(cpus: set[int], *also):
    """A ``preexec_fn`` that pins the child (and the processes it starts) to ``cpus``."""

    def pin() -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)
        for fn in also:
            fn()

    return pin


def cli(*args: str, cpus: set[int] = frozenset()) -> str:
    proc = subprocess.run([sys.executable, "-m", "torchrec_cloud", *args], capture_output=True, text=True,
                          preexec_fn=pinned(cpus))  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"torchrec-cloud {' '.join(args[:2])}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return proc.stdout


def make_model(folder: Path) -> Path:
    """The quickstart's model at 10,000 rows a table (docs/serving.md's three commands), a
    short run, exported in both formats."""
    cli("train", "--preset", "quickstart", "--num_embeddings", "10000", "--num_batches_per_epoch", "40",
        "--num_epochs", "1", "--checkpoint_path", str(folder / "ck"), "--output_dir", str(folder / "run"),
        "--no-progress", "--no-tensorboard")  # fmt: skip
    cli("export", str(folder / "ck"), "--output", str(folder / "model"), "--format", "torchscript,pt2")
    return folder / "model"


def rows_and_bodies(folder: Path, rows: int) -> tuple[Path, dict[int, Path]]:
    """A raw Criteo TSV of ``rows`` rows, and v1 bodies of 1 and 64 of its rows."""
    from torchrec_cloud.data.criteo_gen import write_criteo_tsv

    tsv = folder / "rows.tsv"
    write_criteo_tsv(str(tsv), rows, seed=7)
    instances = []
    for line in tsv.read_text().splitlines():
        fields = line.split("\t")[1:]  # the label first
        row = {f"int_{i}": (int(v) if v else None) for i, v in enumerate(fields[:13])}
        row.update({f"cat_{i}": (v or None) for i, v in enumerate(fields[13:])})
        instances.append(row)
    bodies = {}
    for n in (1, 64):
        bodies[n] = folder / f"body{n}.json"
        bodies[n].write_text(json.dumps({"instances": instances[:n]}))
    return tsv, bodies


OFFLINE_REPEATS = 16


def offline_rows_per_s(model: Path, tsv: Path, out: Path) -> float:
    """``predict``'s rows/s on the rows repeated ``OFFLINE_REPEATS`` times, the faster of two
    runs: the limit is steady-state scoring, which one pass over a few thousand rows (one
    batch, scored while the TorchScript executor still profiles it) is not."""
    many = tsv.with_name("offline.tsv")
    many.write_bytes(tsv.read_bytes() * OFFLINE_REPEATS)
    best = 0.0
    for _ in range(2):
        report = json.loads(cli("predict", str(model), "--input", str(many), "--output", str(out), "--json",
                                "--no_progress", cpus=SERVER_CPUS).strip().splitlines()[-1])  # fmt: skip
        best = max(best, report["rows"] / report["seconds"])
    return best


class Server:
    def __init__(self, model: Path, runtime: str, log: Path, workers: int, *flags: str) -> None:
        # A process group of its own (killed whole by stop), in this session: Linux's autogroup
        # scheduling shares the cores fairly between sessions, and a nice value orders threads
        # only within one, so a server in a session of its own would not let wrk ahead of it.
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "torchrec_cloud", "serve", str(model), "--name", "m", "--host", "127.0.0.1",
             "--port", str(self.port), "--runtime", runtime, "--workers", str(workers), *flags],
            stdout=subprocess.DEVNULL, stderr=open(log, "w"), preexec_fn=pinned(SERVER_CPUS, os.setpgrp))  # fmt: skip
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/v2/health/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                if self.proc.poll() is not None:
                    raise SystemExit(f"serve exited {self.proc.returncode}:\n{log.read_text()[-3000:]}")
                time.sleep(0.2)
        raise SystemExit("serve was not ready in 300 s")

    def log_size(self) -> int:
        return self.log.stat().st_size

    def own_latency_ms(self, since: int) -> tuple[float, float]:
        """p50 and p99 of the server's own time (its access log: from a request's headers to
        its answer written) of the 200 answers logged after byte ``since`` of the log: what
        wrk measures beyond it was spent in the sockets and in wrk (waiting for a core)."""
        with open(self.log, "rb") as fh:
            fh.seek(since)
            text = fh.read().decode("utf-8", "replace")
        times = sorted(float(m.group(1)) for m in re.finditer(r"^access \S+ POST \S+ 200 .*? ([0-9.]+)ms", text, re.M))
        if not times:
            return float("nan"), float("nan")
        return times[len(times) // 2], times[min(len(times) - 1, int(len(times) * 0.99))]

    def cpu_s(self) -> float:
        """The server's CPU seconds so far (user + system, all its threads, and its worker
        processes' with --workers), from /proc."""
        pid = self.proc.pid
        pids = [pid, *map(int, Path(f"/proc/{pid}/task/{pid}/children").read_text().split())]
        ticks = 0
        for p in pids:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])
        return ticks / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)


def wrk_priority() -> list[str]:
    """``nice -n -10`` where this user may raise a process's priority, else nothing. wrk shares
    the machine's cores with the server: a wrk thread waiting for a core adds its wait to
    every latency it measures, which a client on its own machine would not; ahead of the
    server in the scheduler's queue, wrk measures the server's latency."""
    probe = subprocess.run(["nice", "-n", "-10", "nice"], capture_output=True, text=True)
    return ["nice", "-n", "-10"] if probe.stdout.strip() == "-10" else []


WRK_PRIORITY: list[str] = []


def server_cpus(spec: str) -> set[int]:
    """``--server_cpus``: ``all`` (no pinning: empty), ``auto`` (the upper half of this
    process's CPUs, none on a 1-CPU machine) or a taskset list (``0,2-3``)."""
    mine = sorted(os.sched_getaffinity(0))
    if spec == "all":
        return set()
    if spec == "auto":
        return set(mine[len(mine) // 2 :]) if len(mine) > 1 else set()
    try:
        cpus = set()
        for part in spec.split(","):
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    except ValueError:
        raise SystemExit(f"--server_cpus {spec!r}: not a CPU list like 0,2-3 (or auto, all)") from None
    if not cpus or not cpus < set(mine):
        raise SystemExit(f"--server_cpus {spec!r}: must be some of this process's CPUs {mine}, leaving wrk one at least")
    return cpus


def wrk_threads() -> int:
    """wrk's threads at most: two, or one per CPU it has where it has fewer."""
    return min(2, len(WRK_CPUS) or 2)


def where() -> str:
    if not SERVER_CPUS:
        return f"server and wrk on every CPU, wrk {'at nice -10' if WRK_PRIORITY else 'at the server priority'}"
    threads = wrk_threads()
    return (f"server and the offline limit on CPUs {sorted(SERVER_CPUS)}, wrk on {sorted(WRK_CPUS)} "
            f"({'one thread' if threads == 1 else f'{threads} threads'})")


def cpu_ticks() -> dict[str, list[int]]:
    """/proc/stat's time of each CPU (user, nice, system, idle, iowait, irq, softirq, steal)."""
    lines = Path("/proc/stat").read_text().splitlines()
    return {f[0]: list(map(int, f[1:9])) for f in map(str.split, lines) if f[0].startswith("cpu") and f[0] != "cpu"}


def stolen(before: dict[str, list[int]], after: dict[str, list[int]]) -> float:
    """The share of the server's CPUs' time (every CPU's, unpinned) that the hypervisor gave to
    other machines (steal): a cloud VM's neighbours slow a run down by that much, which no
    figure of the server's own can show."""
    names = [f"cpu{c}" for c in SERVER_CPUS] if SERVER_CPUS else list(after)
    total = sum(a - b for n in names for a, b in zip(after[n], before[n]))
    return sum(after[n][7] - before[n][7] for n in names) / max(total, 1)


def wrk(url: str, body: Path, clients: int, seconds: float, script: Path) -> dict:
    cmd = [*WRK_PRIORITY, "wrk", "-t", str(min(clients, wrk_threads())), "-c", str(clients), "-d", f"{seconds:g}s", "--timeout", "30s",
           "-s", str(script), url + "/v1/models/m:predict"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "BODY_FILE": str(body)},
                          preexec_fn=pinned(WRK_CPUS))  # fmt: skip
    line = next((x for x in proc.stdout.splitlines() if x.startswith("WRK ")), None)
    if line is None:
        raise SystemExit(f"wrk: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return json.loads(line[4:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="an exported Criteo-layout model folder (default: train and export one)")
    parser.add_argument("--rows", type=int, default=4096, help="raw rows for predict and the request bodies")
    parser.add_argument("--seconds", type=float, default=10.0, help="each wrk run's duration")
    parser.add_argument("--runtimes", default="torchscript,pt2")
    parser.add_argument("--json", action="store_true", help="one JSON line per run as well")
    parser.add_argument("--server_cpus", default="auto",
                        help="CPUs for the server and the offline limit, as taskset -c (0,2-3); wrk gets the rest "
                             "(auto: the upper half; all: no pinning, shared with wrk)")  # fmt: skip
    parser.add_argument("--workers", type=int, help="serve --workers (default: one per server CPU)")
    parser.add_argument("--max_delay_ms", type=float, default=0.0,
                        help="serve --max_delay_ms (0, serve's default: a loop turn's requests scored at its end)")  # fmt: skip
    parser.add_argument("--wrk_same_priority", action="store_true",
                        help="run wrk at the server's priority (default: ahead of it where allowed, nice -10)")  # fmt: skip
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is not installed: apt-get install wrk (Debian's package)")

    SERVER_CPUS.update(server_cpus(args.server_cpus))
    WRK_CPUS.update(os.sched_getaffinity(0) - SERVER_CPUS if SERVER_CPUS else ())
    args.workers = args.workers or len(SERVER_CPUS or os.sched_getaffinity(0))
    WRK_PRIORITY[:] = [] if args.wrk_same_priority or SERVER_CPUS else wrk_priority()
    folder = Path(tempfile.mkdtemp(prefix="serving-load-"))
    model = Path(args.model) if args.model else make_model(folder)
    tsv, bodies = rows_and_bodies(folder, args.rows)
    script = folder / "post.lua"
    script.write_text(WRK_SCRIPT)
    # The limit is measured before the first run and again after every run, and each run is set
    # against the mean of the measurements just before and after it: this machine's speed drifts
    # within minutes (bench/RESULTS.md), by more than a measurement a runtime's block apart allows.
    limits = [offline_rows_per_s(model, tsv, folder / "scores.csv")]
    print(f"offline predict --input: {limits[0]:,.0f} rows/s ({args.rows} rows x {OFFLINE_REPEATS}, the faster of 2 "
          "runs; measured again after every run)", flush=True)  # fmt: skip
    # serve parses HTTP with httptools when it is installed, h11 otherwise, and runs on uvloop
    # when it is installed, asyncio's loop otherwise: say which ran (the server's ready line says so too).
    http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    print(f"serve's HTTP parser: {http} (httptools when installed); event loop: {loop} (uvloop when installed)",
          flush=True)  # fmt: skip
    print(f"serve --workers {args.workers} --max_delay_ms {args.max_delay_ms:g}: {args.workers} worker process(es) on "
          "the port", flush=True)  # fmt: skip
    print(f"CPUs: {where()}", flush=True)
    table = []
    for runtime in args.runtimes.split(","):
        server = Server(model, runtime, folder / f"serve-{runtime}.log", args.workers, "--max_delay_ms",
                        f"{args.max_delay_ms:g}")  # fmt: skip
        try:
            for n, body in bodies.items():
                for clients in (1, 16, 64):
                    wrk(server.url, body, 4, 1, script)  # the server warm again after the idle limit
                    cpu, since, ticks = server.cpu_s(), server.log_size(), cpu_ticks()
                    r = wrk(server.url, body, clients, args.seconds, script)
                    time.sleep(0.2)  # the last turn's access lines are written at the next turn
                    own_p50, own_p99 = server.own_latency_ms(since)
                    # The server's own CPU per request: what a busy shared machine does not distort.
                    cpu_us = (server.cpu_s() - cpu) / max(r["requests"], 1) * 1e6
                    steal = stolen(ticks, cpu_ticks())
                    rows_per_s = r["requests"] * n / r["seconds"]
                    limits.append(offline_rows_per_s(model, tsv, folder / "scores.csv"))
                    limit = (limits[-2] + limits[-1]) / 2
                    row = {"runtime": runtime, "rows_per_request": n, "clients": clients, "rows_per_s": rows_per_s,
                           "of_offline": rows_per_s / limit, "offline_rows_per_s": limit,
                           "server_cpu_us_per_request": cpu_us, "server_p50_ms": own_p50, "server_p99_ms": own_p99,
                           "steal": steal,
                           **r}  # fmt: skip
                    table.append(row)
                    print(f"{runtime} {n}-row requests, {clients} clients: {rows_per_s:,.0f} rows/s, "
                          f"{row['of_offline']:.0%} of offline ({limits[-2]:,.0f} before, {limits[-1]:,.0f} after), "
                          f"p50 {r['p50_ms']:.1f} ms, p95 {r['p95_ms']:.1f} ms, "
                          f"p99 {r['p99_ms']:.1f} ms, not 200: {r['non_2xx']}, socket errors {r['socket_errors']}, "
                          f"server CPU {cpu_us:,.0f} us a request, the server's own p50 {own_p50:.1f} ms p99 {own_p99:.1f} ms, "
                          f"steal {steal:.0%}",
                          flush=True)  # fmt: skip
                    if args.json:
                        print(json.dumps(row), flush=True)
        finally:
            server.stop()

    # The shedding point: more waiting requests than the queue holds.
    log = folder / "serve-shed.log"
    server = Server(model, "torchscript", log, args.workers, "--max_queue", "8", "--max_delay_ms", f"{args.max_delay_ms:g}")
    try:
        shed = wrk(server.url, bodies[64], 256, args.seconds, script)
    finally:
        server.stop()
    times = [float(m.group(1)) for m in re.finditer(r" 503 .*?([0-9.]+)ms(?: worker=[0-9]+)?$", log.read_text(), re.M)]
    shed_line = (f"shedding: 256 clients of 64-row requests, --max_queue 8: {shed['non_2xx']} of {shed['requests']} "
                 f"answered 503" + (f", in {statistics.median(times):.2f} ms median, {max(times):.2f} ms at most "
                                    "(the server's own time)" if times else ""))  # fmt: skip
    print(shed_line, flush=True)

    print("\n| runtime | rows/request | clients | rows/s | of offline (its limit) | p50 ms | p95 ms | p99 ms | not 200 | server CPU us/request "
          "| server's own p50 / p99 ms | steal |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in table:
        print(f"| {r['runtime']} | {r['rows_per_request']} | {r['clients']} | {r['rows_per_s']:,.0f} | "
              f"{r['of_offline']:.0%} ({r['offline_rows_per_s']:,.0f}) | {r['p50_ms']:.1f} | {r['p95_ms']:.1f} | {r['p99_ms']:.1f} | {r['non_2xx']} | "
              f"{r['server_cpu_us_per_request']:,.0f} | {r['server_p50_ms']:.1f} / {r['server_p99_ms']:.1f} | {r['steal']:.0%} |")
    print(f"\noffline `predict --input`, same model and rows: {', '.join(f'{x:,.0f}' for x in limits)} rows/s (at the "
          f"start and after every run); HTTP parser {http}; "
          f"event loop {loop}; serve --workers {args.workers} --max_delay_ms {args.max_delay_ms:g}; {where()}. "
          f"{shed_line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
