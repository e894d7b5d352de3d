"""The speed-ups layer changes how the step runs, not what it computes: a run with
``--no-speedups`` (TorchRec's DLRM as built, fbgemm's row-wise Adagrad, plain gloo) learns, and
gives the metrics of a run with the layer on, to float rounding; the start record says what
was applied and why not.

How close, measured on this config (planted data, lr 0.1): on 1 rank every train loss and
evaluation metric agrees to ~1e-7 relative over 40 steps (the C kernels sum in another order
than MKL, and those roundings stay that small); on 2 ranks to ~1e-7 over the first 20 steps,
after which the roundings compound (~1e-4 by step 40). The assertions leave a margin above those.
"""

import pytest

from helpers import PYTHON, TINY, evals, explain, read_metrics, run, shm_usable, torchrun

ARGS = [*TINY, "--synthetic", "planted", "--learning_rate", "0.1", "--log_every", "5", "--no-tensorboard"]


def _metrics(records: list[dict]) -> list[tuple]:
    out = []
    for r in records:
        if r["event"] == "train":
            out.append((r["step"], "train", "loss", r["loss"]))
        elif r["event"] == "eval":
            out += [(r["step"], r["split"], key, r[key]) for key in ("auc", "logloss", "ne")]
    return out


def _assert_close(on: list[dict], off: list[dict], rel: float) -> None:
    a, b = _metrics(on), _metrics(off)
    assert [x[:3] for x in a] == [x[:3] for x in b] and len(a) > 5
    for x, y in zip(a, b):
        assert x[3] == pytest.approx(y[3], rel=rel), (x, y)


def test_one_rank_without_the_layer_gives_the_same_metrics(tmp_path):
    records = {}
    for name, flags in (("on", []), ("off", ["--no-speedups"])):
        out = tmp_path / name
        proc = run([PYTHON, "-m", "torchrec_cloud", "train", *ARGS, "--num_batches_per_epoch", "40",
                    "--eval_every", "20", *flags, "--output_dir", str(out)])  # fmt: skip
        assert proc.returncode == 0, explain(proc)
        records[name] = read_metrics(out)
    on, off = records["on"][0]["speedups"], records["off"][0]["speedups"]
    assert off["applied"] == [] and set(off["not_applied"].values()) == {"--no-speedups"}
    assert {"tables_first", "pooled_in_place", "dot_interaction", "bias_relu", "aligned_first_layers",
            "cpu_kernels", "rowwise_adagrad"} == set(on["applied"])  # fmt: skip
    assert on["not_applied"] == {"shm_collectives": "one rank"}
    _assert_close(records["on"], records["off"], rel=1e-6)
    assert evals(records["off"], "test")[-1]["auc"] > 0.6  # the plain path learns too


def test_two_ranks_without_the_layer_give_the_same_metrics(tmp_path):
    records = {}
    for name, flags in (("on", []), ("off", ["--no-speedups"])):
        out = tmp_path / name
        proc = torchrun(2, ["-m", "torchrec_cloud", "train", *ARGS, "--num_batches_per_epoch", "20",
                            "--eval_every", "10", *flags, "--output_dir", str(out)])  # fmt: skip
        assert proc.returncode == 0, explain(proc)
        records[name] = read_metrics(out)
    expected = "shared memory + gloo" if shm_usable() else "gloo"
    assert records["on"][0]["collectives"] == expected and records["off"][0]["collectives"] == "gloo"
    _assert_close(records["on"], records["off"], rel=1e-5)
