"""The bench command's contract: its last line is one JSON object with the figures."""

import json

from helpers import PYTHON, explain, run

KEYS = (
    "bound_samples_per_s", "ours_samples_per_s", "ours_2rank_samples_per_s",
    "handwritten_samples_per_s", "ours_peak_rss_mb", "handwritten_peak_rss_mb",
)  # fmt: skip


def test_bench_json_last_line_has_every_figure():
    # Tiny steps and tables: this checks the plumbing, the numbers are measured by `make bench`.
    proc = run([PYTHON, "-m", "torchrec_cloud", "bench", "--json", "--steps", "2", "--warmup", "1",
                "--batch_size", "256", "--", "--num_embeddings", "1000"])  # fmt: skip
    assert proc.returncode == 0, explain(proc)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in KEYS:
        assert result[key] > 0, (key, result)
    assert abs(result["ours_vs_bound"] - result["ours_samples_per_s"] / result["bound_samples_per_s"]) < 1e-9
    # FLOPs per sample of the quickstart dense compute: MLPs + interaction, fwd + bwd.
    assert 2.5e6 < result["flops_per_sample"] < 4.0e6
    assert "hand-written PyTorch" in proc.stdout
