"""Test helpers: a real Prometheus server, and one real training run it scrapes.

The server is the Debian package's binary: ``scripts/get-prometheus.sh`` unpacks it once
into the virtualenv running the tests (``<venv>/opt/prometheus/bin``), so a second run
finds it at once. Each server runs on 127.0.0.1 with a temporary config and TSDB and is
stopped after its test.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from torchrec_cloud.ports import free_port

REPO = Path(__file__).resolve().parents[1]


def http_get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def prometheus_binary() -> Path:
    """Path of the ``prometheus`` binary (``promtool`` sits beside it); fails the test if none."""
    dest = Path(sys.prefix) / "opt" / "prometheus"
    r = subprocess.run(
        ["bash", str(REPO / "scripts" / "get-prometheus.sh"), str(dest)],
        capture_output=True, text=True, timeout=600,
    )
    if r.returncode != 0:
        pytest.fail(f"cannot get a Prometheus server for the tests:\n{r.stderr}")
    return Path(r.stdout.strip().splitlines()[-1])


class PrometheusServer:
    """Prometheus on 127.0.0.1 with ``config`` (prometheus.yml text) and a temporary TSDB."""

    def __init__(self, binary: Path, workdir: Path, config: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "prometheus.yml").write_text(config)
        self._log_path = workdir / "prometheus.log"
        self._log = open(self._log_path, "w")
        self.proc = subprocess.Popen(
            [
                str(binary),
                f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self._log, stderr=subprocess.STDOUT,
        )
        deadline = time.time() + 60
        while True:
            try:
                if "Ready" in http_get(self.url + "/-/ready", timeout=1):
                    break
            except OSError:
                pass
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                pytest.fail(f"Prometheus did not start:\n{self._log_path.read_text()[-3000:]}")
            time.sleep(0.2)

    @staticmethod
    def static_config(targets: list[str], interval: str = "1s", timeout: str = "200ms") -> str:
        return (
            f"global:\n  scrape_interval: {interval}\n  scrape_timeout: {timeout}\n"
            "scrape_configs:\n  - job_name: torchrec\n    static_configs:\n"
            f"      - targets: {json.dumps(targets)}\n"
        )

    def api(self, path: str, **params) -> dict:
        body = json.loads(http_get(f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"))
        assert body["status"] == "success", body
        return body["data"]

    def samples(self, metric: str, at: float, window_s: int = 900) -> list[dict]:
        """The raw samples of ``metric`` scraped in the ``window_s`` seconds before ``at``."""
        return self.api("query", query=f"{metric}[{window_s}s]", time=at)["result"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> "PrometheusServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


# ---------------------------------------------------------------------------------------
# One short 2-rank training run, scraped by Prometheus, shared by the Prometheus,
# TensorBoard and report tests (a trainer start costs seconds of torch/TorchRec imports
# and planning).


@dataclass
class ObservedRun:
    output_dir: Path
    records: list[dict]
    start: float
    end: float
    samples: dict[str, list[dict]]  # metric -> Prometheus query result (raw samples)
    targets: list[str]  # host:port of each rank's endpoint


SCRAPED = (
    "torchrec_train_samples_per_second",
    "torchrec_train_loss",
    "torchrec_train_step",
    "torchrec_eval_auc",
    "torchrec_host_memory_used_bytes",
    "torchrec_train_step_phase_seconds",
    "up",
)
TINY_MODEL = [
    "--num_embeddings", "1000", "--embedding_dim", "16",
    "--dense_arch_layer_sizes", "32,16", "--over_arch_layer_sizes", "32,1", "--batch_size", "256",
]
_cache: dict[str, ObservedRun] = {}


def observed_run(tmp_path_factory) -> ObservedRun:
    """Train 80 steps of a tiny planted-data model on 2 ranks (torchrun, gloo) with
    ``--prometheus_port``; a Prometheus server scrapes both ranks' endpoints 4x a second.

    The endpoints stay up after training (``--prometheus_linger``), as a collector's last
    scrape needs them to, until Prometheus has stored the run's last step and last
    evaluation from both ranks: what a user sees at the end, whatever the machine's speed
    (a fast run may end before its first scrape). The run is then stopped."""
    if "run" in _cache:
        return _cache["run"]
    work = tmp_path_factory.mktemp("observed")
    binary = prometheus_binary()
    metrics_port = free_port(2)
    out = work / "run"
    targets = [f"127.0.0.1:{metrics_port}", f"127.0.0.1:{metrics_port + 1}"]
    with PrometheusServer(
        binary, work / "prometheus", PrometheusServer.static_config(targets, interval="250ms"),
    ) as server:
        start = time.time()
        log = open(work / "train.log", "w")
        proc = subprocess.Popen(
            [
                sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                "-m", "torchrec_cloud", "train", "--synthetic", "planted",
                *TINY_MODEL,
                "--num_batches_per_epoch", "80", "--log_every", "4", "--eval_every", "40",
                "--num_eval_batches", "1", "--no-progress", "--output_dir", str(out),
                "--prometheus_port", str(metrics_port), "--metrics_host", "127.0.0.1",
                "--system_metrics_interval", "0.25", "--prometheus_linger", "600",
            ],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "PYTHONPATH": str(REPO / "src")},
        )
        try:
            _wait_for_the_last_scrape(server, out, proc, work / "train.log")
        finally:
            os.killpg(proc.pid, signal.SIGKILL)  # lingering for the scrapes only
            proc.wait()
            log.close()
        end = time.time()
        window = int(end - start) + 5
        samples = {m: server.samples(m, end, window) for m in SCRAPED}
    records = _records(out)
    _cache["run"] = ObservedRun(out, records, start, end, samples, targets)
    return _cache["run"]


def _records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _wait_for_the_last_scrape(server: PrometheusServer, out: Path, proc: subprocess.Popen, log: Path) -> None:
    """Until both ranks' endpoints have been scraped since the run logged its end: the last
    step and the last validation AUC (a generous deadline only stops a hang)."""
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the training run ended (exit {proc.returncode}) before its lingering endpoints were "
                        f"scraped:\n{log.read_text()[-3000:]}")  # fmt: skip
        records = _records(out)
        if any(r.get("event") == "end" for r in records):
            step = [r for r in records if r.get("event") == "train"][-1]["step"]
            auc = [r for r in records if r.get("event") == "eval" and r["split"] == "val"][-1]["auc"]
            steps = {r["metric"]["rank"]: float(r["value"][1]) for r in server.api("query", query="torchrec_train_step")["result"]}
            aucs = [float(r["value"][1]) for r in server.api("query", query='torchrec_eval_auc{split="val"}')["result"]]
            if steps == {"0": step, "1": step} and len(aucs) == 2 and all(math.isclose(a, auc, rel_tol=1e-9) for a in aucs):
                return
        time.sleep(0.25)
    pytest.fail("Prometheus never stored the run's last step and evaluation from both ranks")
