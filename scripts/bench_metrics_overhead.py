"""What the Prometheus endpoint costs a training process: prints microseconds per record.

    PYTHONPATH=src python scripts/bench_metrics_overhead.py

Figures: one ``sink.log`` of a train record (the trainer logs one per --log_every steps),
one scrape of /metrics as a collector does it, and one GPU/host sample of the background
thread (every --system_metrics_interval seconds).
"""

from __future__ import annotations

import socket
import time
import urllib.request

from torchrec_cloud.metrics.prometheus import PrometheusSink


def main(records: int = 20_000, scrapes: int = 50, samples: int = 200) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sink = PrometheusSink(port, host="127.0.0.1", system_metrics_interval=60)
    record = {"event": "train", "step": 0, "loss": 0.5, "samples_per_s": 1e4, "lr": 0.1,
              "world_size": 1, "data_wait_s": 0.001, "step_s": 0.01}
    try:
        t = time.perf_counter()
        for i in range(records):
            record["step"] = i
            sink.log(record)
        per_log = (time.perf_counter() - t) / records
        t = time.perf_counter()
        for _ in range(scrapes):
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        per_scrape = (time.perf_counter() - t) / scrapes
        t = time.perf_counter()
        for _ in range(samples):
            sink._system.sample()
        per_sample = (time.perf_counter() - t) / samples
    finally:
        sink.close()
    print(f"log(train record): {per_log * 1e6:.1f} us")
    print(f"scrape /metrics:   {per_scrape * 1e3:.2f} ms ({len(body)} bytes, gpu series: {sink.has_gpu})")
    print(f"system sample:     {per_sample * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
