"""A real Prometheus server for tests: fetched once, started on 127.0.0.1, stopped after.

``scripts/get-prometheus.sh`` unpacks the Debian package's binaries into the virtualenv
running the tests (``<venv>/opt/prometheus/bin``), so the second run finds them at once.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    def static_config(targets: list[str], interval: str = "1s") -> str:
        return (
            f"global:\n  scrape_interval: {interval}\n  scrape_timeout: 900ms\n"
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
