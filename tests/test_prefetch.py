"""Batches made ahead (worker processes, or a reading thread): same batches, same order,
same training."""

import threading
import time

import pytest

from helpers import PYTHON, TINY, explain, read_metrics, run
from torchrec_cloud.data.prefetch import prefetched


def _threads() -> int:
    return sum(t.name == "batch-prefetch" for t in threading.enumerate())


def test_order_is_kept_and_work_overlaps():
    made = []

    def slow():
        for i in range(6):
            time.sleep(0.05)  # making a batch
            made.append(i)
            yield i

    items = prefetched(slow(), depth=2)
    assert next(items) == 0
    time.sleep(0.3)  # the consumer's step: the thread makes the next ones meanwhile
    assert made[:3] == [0, 1, 2]  # two ahead (queue) + one in hand, not all six
    assert list(items) == [1, 2, 3, 4, 5]
    assert _threads() == 0


def test_an_error_is_raised_at_its_batch():
    def broken():
        yield 0
        yield 1
        raise ValueError("shard 3: bad line 17")

    items = prefetched(broken(), depth=4)
    assert [next(items), next(items)] == [0, 1]
    with pytest.raises(ValueError, match="bad line 17"):
        next(items)


def test_closing_early_stops_the_thread():
    def endless():
        i = 0
        while True:
            yield i
            i += 1

    items = prefetched(endless(), depth=2)
    assert [next(items) for _ in range(3)] == [0, 1, 2]
    items.close()
    assert _threads() == 0


def test_training_with_data_workers_is_the_same_training(tmp_path):
    # Synthetic batches from 2 DataLoader worker processes, then from the reading thread
    # (a Criteo-like source), against batches made in the step.
    script = tmp_path / "threaded.py"
    script.write_text(
        "import sys\n"
        "from torchrec_cloud.config import parse_job_config\n"
        "from torchrec_cloud.data.synthetic import SyntheticSource\n"
        "from torchrec_cloud.train import run\n"
        "class NotSynthetic:\n"  # any other DataSource: read ahead by one thread
        "    def __init__(self, inner): self.inner = inner\n"
        "    def __getattr__(self, name): return getattr(self.inner, name)\n"
        "cfg = parse_job_config(sys.argv[1:])\n"
        "run(cfg, source=NotSynthetic(SyntheticSource(cfg, 0, 1)))\n"
    )
    losses = {}
    for name, launch in (("0", ["-m", "torchrec_cloud", "train"]), ("2", ["-m", "torchrec_cloud", "train"]),
                         ("thread", [str(script)])):  # fmt: skip
        out = tmp_path / name
        workers = "0" if name == "0" else "2"
        args = [PYTHON, *launch, *TINY, "--log_every", "2", "--eval_every", "5", "--data_workers", workers,
                "--no-tensorboard", "--output_dir", str(out)]  # fmt: skip
        proc = run(args)
        assert proc.returncode == 0, explain(proc)
        records = read_metrics(out)
        losses[name] = [(r["event"], r["step"], r.get("split"), r["loss"]) for r in records[1:]
                        if r["event"] in ("train", "eval")]  # fmt: skip
    assert len(losses["0"]) > 5
    assert losses["2"] == losses["0"] and losses["thread"] == losses["0"]


def _labels(batches) -> list[list[float]]:
    return [b.labels.tolist() for b in batches]


def test_worker_processes_make_what_the_source_says(tmp_path):
    # `train`'s choice of batches with 2 worker processes, for the plain source and for
    # subclasses that change which batches a rank trains on in either of the two ways.
    from torchrec_cloud.config import parse_job_config
    from torchrec_cloud.data.synthetic import SyntheticSource

    cfg = parse_job_config([*TINY, "--num_batches_per_epoch", "6", "--output_dir", str(tmp_path)])

    class FirstThree(SyntheticSource):  # overrides train_batches: the loader cannot see it
        def train_batches(self, epoch, start_batch=0):
            for i, b in enumerate(super().train_batches(epoch, start_batch)):
                if i == 3:
                    return
                yield b

    class EveryOther(SyntheticSource):  # overrides the index list: the loader uses it
        def train_indices(self, epoch, start_batch=0):
            return super().train_indices(epoch, start_batch)[::2]

    for source, expected in ((SyntheticSource(cfg, 0, 1), 5), (FirstThree(cfg, 0, 1), 3), (EveryOther(cfg, 0, 1), 3)):
        made = _labels(source.train_batches_ahead(1, 1, workers=2, pin=False))
        assert len(made) == expected, type(source).__name__
        assert made == _labels(source.train_batches(1, 1)), type(source).__name__
