"""The Prometheus endpoint, scraped by a real Prometheus server during a real training run.

The server is the Debian package's binary, fetched once by scripts/get-prometheus.sh into
the virtualenv running the tests, started here on 127.0.0.1 with a temporary config and
storage folder, and stopped after.
"""

from __future__ import annotations

import math
import socket
import subprocess
import time
from pathlib import Path

import pytest
from observed_run import free_port, http_get, observed_run, prometheus_binary

from torchrec_cloud.config import ConfigError, parse_job_config
from torchrec_cloud.metrics import build_sinks
from torchrec_cloud.metrics.prometheus import PrometheusSink


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """``{(name, sorted label items): value}`` of one scrape of the endpoint."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(http_get(f"http://127.0.0.1:{port}/metrics")):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@pytest.fixture(scope="module")
def prometheus_bin() -> Path:
    return prometheus_binary()


# ---------------------------------------------------------------------------------------
# The endpoint itself.


def test_endpoint_exports_records_and_host_gauges(prometheus_bin: Path, tmp_path: Path) -> None:
    port = free_port()
    sink = PrometheusSink(port, host="127.0.0.1", rank=3, system_metrics_interval=0.2)
    try:
        before = scrape(port)
        # Nothing logged yet: no training series at all (a 0 would read as a real loss).
        assert not any(name.startswith("torchrec_train") for name, _ in before)
        started = time.time()
        sink.log({"event": "start", "world_size": 4, "bayes_auc": 0.81})
        sink.log({"event": "train", "step": 20, "loss": 0.52, "samples_per_s": 5120.0,
                  "lr": 0.01, "world_size": 4, "data_wait_s": 0.003, "step_s": 0.05})
        sink.log({"event": "eval", "split": "val", "step": 20, "auc": 0.74, "logloss": 0.5})
        sink.log({"event": "checkpoint", "step": 20, "seconds": 1.25, "bytes": 4096, "path": "p"})
        sink.log({"event": "resume", "step": 20, "seconds": 0.5, "bytes": 4096})
        m = scrape(port)
        text = http_get(f"http://127.0.0.1:{port}/metrics")
    finally:
        sink.close()
    r = (("rank", "3"),)
    assert m[("torchrec_train_step", r)] == 20
    assert m[("torchrec_train_loss", r)] == 0.52
    assert m[("torchrec_train_samples_per_second", r)] == 5120.0
    assert m[("torchrec_learning_rate", r)] == 0.01
    assert m[("torchrec_world_size", r)] == 4
    assert m[("torchrec_data_bayes_auc", r)] == 0.81
    assert started <= m[("torchrec_run_start_time_seconds", r)] <= time.time()
    assert m[("torchrec_train_step_phase_seconds", (("phase", "data_wait"), ("rank", "3")))] == 0.003
    assert m[("torchrec_train_step_phase_seconds", (("phase", "total"), ("rank", "3")))] == 0.05
    assert m[("torchrec_eval_auc", (("rank", "3"), ("split", "val")))] == 0.74
    assert m[("torchrec_eval_logloss", (("rank", "3"), ("split", "val")))] == 0.5
    assert m[("torchrec_checkpoint_save_seconds", r)] == 1.25
    assert m[("torchrec_checkpoint_save_bytes", r)] == 4096
    assert m[("torchrec_checkpoint_saves_total", r)] == 1
    assert m[("torchrec_checkpoint_load_seconds", r)] == 0.5
    assert m[("torchrec_host_memory_total_bytes", r)] > 2**20
    assert 0 < m[("torchrec_host_memory_used_bytes", r)] <= m[("torchrec_host_memory_total_bytes", r)]
    assert 0.0 <= m[("torchrec_host_cpu_utilization_ratio", r)] <= 1.0
    assert m[("process_resident_memory_bytes", ())] > 0
    # Prometheus's own linter accepts every name, type and help text.
    promtool = prometheus_bin.parent / "promtool"
    lint = subprocess.run([str(promtool), "check", "metrics"], input=text, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    # Closed: nothing answers on the port any more.
    with pytest.raises(OSError):
        http_get(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_each_local_rank_serves_its_own_port(tmp_path: Path) -> None:
    base = free_port()
    while True:  # base + 1 must be free too
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", base + 1))
            break
        except OSError:
            base = free_port()
    cfg = parse_job_config([
        "--output_dir", str(tmp_path / "run"), "--prometheus_port", str(base),
        "--metrics_host", "127.0.0.1",
    ])
    sink = build_sinks(cfg, rank=5, local_rank=1, world_size=8)
    try:
        sink.log({"event": "train", "step": 7, "loss": 0.6, "samples_per_s": 10.0})
        assert scrape(base + 1)[("torchrec_train_step", (("rank", "5"),))] == 7
    finally:
        sink.close()
    # A non-zero rank writes no files: metrics.jsonl and TensorBoard belong to rank 0.
    assert not (tmp_path / "run").exists()


def test_endpoint_lingers_after_the_run_for_the_last_scrape() -> None:
    import threading

    port = free_port()
    sink = PrometheusSink(port, host="127.0.0.1", system_metrics_interval=60, linger=1.5)
    sink.log({"event": "eval", "split": "test", "step": 9, "auc": 0.77, "logloss": 0.5})
    closing = threading.Thread(target=sink.close)
    t0 = time.time()
    closing.start()
    time.sleep(0.3)
    # The run is over (close was called) and the final test AUC is still served.
    assert scrape(port)[("torchrec_eval_auc", (("rank", "0"), ("split", "test")))] == 0.77
    closing.join(timeout=10)
    assert time.time() - t0 >= 1.4
    with pytest.raises(OSError):
        http_get(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_busy_port_is_a_flag_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ConfigError) as e:
            PrometheusSink(port, host="127.0.0.1")
    assert e.value.flag == "prometheus_port"
    assert str(port) in str(e.value)


@pytest.mark.parametrize("value", ["0", "65536", "-1"])
def test_port_out_of_range_is_rejected(value: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_job_config(["--prometheus_port", value])
    assert e.value.flag == "prometheus_port"
    assert "1..65535" in str(e.value)


# ---------------------------------------------------------------------------------------
# A real server scraping a real training run.


def by_rank(result: list[dict]) -> dict[str, list[float]]:
    return {r["metric"]["rank"]: [float(v) for _, v in r["values"]] for r in result}


def test_prometheus_scrapes_every_rank_of_a_training_run(tmp_path_factory) -> None:
    """What a user sees in Prometheus after a run, however fast it was: both ranks' series,
    holding only values the trainer logged, up to its last step and last evaluation (the
    run's endpoints linger for that last scrape; observed_run waits for it)."""
    run = observed_run(tmp_path_factory)
    train = [r for r in run.records if r.get("event") == "train"]
    assert train, "the run logged no train records"

    # Both ranks served their own endpoint (PORT and PORT + 1) and both were scraped.
    throughput = by_rank(run.samples["torchrec_train_samples_per_second"])
    assert sorted(throughput) == ["0", "1"]
    assert all(v > 0 for values in throughput.values() for v in values)
    assert {r["metric"]["instance"] for r in run.samples["up"]} == set(run.targets)

    # Every loss Prometheus stored for either rank is one the trainer logged to
    # metrics.jsonl (no made-up or stale zero values; the loss is averaged over ranks), and
    # the last one is the run's last.
    logged = [r["loss"] for r in train]
    loss = by_rank(run.samples["torchrec_train_loss"])
    for v in loss["0"] + loss["1"]:
        assert any(math.isclose(v, x, rel_tol=1e-6) for x in logged), (v, logged[:5])
    assert all(math.isclose(values[-1], logged[-1], rel_tol=1e-6) for values in loss.values())
    # Steps only go up, to the last one logged, on both ranks.
    for values in by_rank(run.samples["torchrec_train_step"]).values():
        assert values == sorted(values) and values[-1] == train[-1]["step"]

    # The last validation AUC was scraped, from both ranks.
    val_auc = [r["auc"] for r in run.records if r.get("event") == "eval" and r["split"] == "val"][-1]
    val_series = [r for r in run.samples["torchrec_eval_auc"] if r["metric"]["split"] == "val"]
    assert len(val_series) == 2 and all(math.isclose(float(r["values"][-1][1]), val_auc, rel_tol=1e-9) for r in val_series)

    phases = {r["metric"]["phase"] for r in run.samples["torchrec_train_step_phase_seconds"]}
    assert {"data_wait", "total"} <= phases
    memory = by_rank(run.samples["torchrec_host_memory_used_bytes"])
    assert sorted(memory) == ["0", "1"] and all(v > 0 for vs in memory.values() for v in vs)
    assert all(any(float(v) == 1.0 for _, v in r["values"]) for r in run.samples["up"])


# ---------------------------------------------------------------------------------------
# GPU gauges.


@pytest.mark.parametrize(
    "visible, local_rank, expected",
    [
        (None, 3, ("", 3)),  # a pod sees only its GPUs: cuda:r is NVML device r
        ("4,5,6,7", 1, ("", 5)),  # CUDA renumbers the visible devices; NVML does not
        ("GPU-1b2c,GPU-9f8e", 1, ("GPU-9f8e", None)),
    ],
)
def test_each_rank_watches_its_own_gpu(monkeypatch, visible, local_rank, expected) -> None:
    from torchrec_cloud.metrics.system import _nvml_device_index

    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert _nvml_device_index(local_rank, device_count=8) == expected


def _nvml_gpu_count() -> int:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return pynvml.nvmlDeviceGetCount()
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return 0


@pytest.mark.skipif(_nvml_gpu_count() == 0, reason="needs an NVIDIA GPU (NVML)")
def test_gpu_gauges_come_from_nvml() -> None:
    port = free_port()
    sink = PrometheusSink(port, host="127.0.0.1", rank=0, local_rank=0, system_metrics_interval=0.2)
    try:
        assert sink.has_gpu
        time.sleep(0.5)
        m = scrape(port)
    finally:
        sink.close()
    g = (("gpu", "0"), ("rank", "0"))
    assert m[("torchrec_gpu_memory_total_bytes", g)] > 2**30
    assert 0 <= m[("torchrec_gpu_memory_used_bytes", g)] <= m[("torchrec_gpu_memory_total_bytes", g)]
    assert 0.0 <= m[("torchrec_gpu_utilization_ratio", g)] <= 1.0


def test_cpu_machine_exports_no_gpu_series() -> None:
    if _nvml_gpu_count():
        pytest.skip("this machine has a GPU")
    port = free_port()
    sink = PrometheusSink(port, host="127.0.0.1", system_metrics_interval=60)
    try:
        names = {name for name, _ in scrape(port)}
    finally:
        sink.close()
    assert not sink.has_gpu
    assert not any(n.startswith("torchrec_gpu_") for n in names)
    assert "torchrec_host_cpu_utilization_ratio" in names
