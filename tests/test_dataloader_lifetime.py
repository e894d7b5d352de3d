"""One stream of training batches per run (issue #43): DataLoader worker processes forked once
and kept across the training segments an evaluation separates, every batch made exactly once
and trained, none made past a segment's end and thrown away; a segment cut short resumes
where it stopped."""

from __future__ import annotations

from collections import Counter

from helpers import PYTHON, TINY, explain, read_metrics, run
from torchrec_cloud.data.prefetch import TrainFeed

# Counts, in the run's own process, every fork (a DataLoader worker starting) and every
# training batch made (in a worker), one line each in the log file.
COUNTED_RUN = """\
import multiprocessing, os, sys
from torchrec_cloud.config import parse_job_config
from torchrec_cloud.data.synthetic import SyntheticSource
from torchrec_cloud.train import run

log = sys.argv[1]

def note(line):
    with open(log, "a") as f:
        f.write(line + "\\n")

os.register_at_fork(after_in_child=lambda: note(f"fork {os.getpid()}"))

class Counted(SyntheticSource):
    def make_batch(self, split, index):
        if split == "train":
            note(f"train {index} {os.getpid()}")
        return super().make_batch(split, index)

cfg = parse_job_config(sys.argv[2:])
run(cfg, source=Counted(cfg, 0, 1))
print("workers left", len(multiprocessing.active_children()))
"""


def test_a_run_forks_its_data_workers_once_and_makes_each_batch_once(tmp_path):
    script, log, out = tmp_path / "counted.py", tmp_path / "made.log", tmp_path / "run"
    script.write_text(COUNTED_RUN)
    epochs, per_epoch = 2, 6
    proc = run([PYTHON, str(script), str(log), *TINY, "--num_epochs", str(epochs), "--num_batches_per_epoch",
                str(per_epoch), "--eval_every", "2", "--data_workers", "2", "--no-tensorboard",
                "--output_dir", str(out)])  # fmt: skip
    assert proc.returncode == 0, explain(proc)
    records = read_metrics(out)
    evaluations = [r for r in records if r["event"] == "eval" and r["split"] == "val"]
    assert len(evaluations) == epochs * per_epoch // 2  # a segment of 2 steps between evaluations
    lines = [line.split() for line in log.read_text().splitlines()]
    forks = [pid for kind, pid, *_ in lines if kind == "fork"]
    made = Counter(int(index) for kind, index, *_ in lines if kind == "train")
    makers = {pid for kind, _, pid in (line for line in lines if line[0] == "train")}
    assert len(forks) == 2, f"{len(forks)} data workers started for {len(evaluations)} evaluations"
    assert makers <= set(forks)
    assert sorted(made) == list(range(epochs * per_epoch)) and set(made.values()) == {1}, made
    assert records[-1]["event"] == "end" and records[-1]["step"] == epochs * per_epoch
    assert "workers left 0" in proc.stdout  # they end with the run


class _Stream:
    """A stream that says how often it was opened and which batches it made."""

    def __init__(self, per_epoch: dict[int, int]) -> None:
        self.per_epoch, self.opened, self.made, self.closed = per_epoch, [], [], False

    def open(self, epoch, first):
        self.opened.append((epoch, first))
        for e in range(epoch, len(self.per_epoch)):
            for i in range(first if e == epoch else 0, self.per_epoch[e]):
                self.made.append((e, i))
                yield e, i, (e, i)

    def close(self):
        self.closed = True


def test_segments_read_one_stream_and_a_cut_segment_reopens_it_where_it_stopped():
    stream = _Stream({0: 4, 1: 4})
    feed = TrainFeed(stream, batches_per_epoch=4)
    assert list(feed.segment(0, 0, 2)) == [(0, 0), (0, 1)]
    assert list(feed.segment(0, 2, 4)) == [(0, 2), (0, 3)]
    cut = feed.segment(1, 0, 4)  # the loop read two batches and trained one (SIGTERM, a timed save)
    assert [next(cut), next(cut)] == [(1, 0), (1, 1)]
    assert stream.opened == [(0, 0)], "segments after evaluations read on from the same stream"
    assert list(feed.segment(1, 1, 4)) == [(1, 1), (1, 2), (1, 3)]
    assert stream.opened == [(0, 0), (1, 1)], "after a cut, opened again where the next segment starts"
    assert list(feed.segment(2, 0, 4)) == []  # the end of training
    feed.close()
    assert stream.closed


def test_an_epoch_that_runs_out_early_hands_the_next_one_its_first_batch():
    stream = _Stream({0: 3, 1: 3})  # the epoch is said to hold 5 batches, this rank has 3
    feed = TrainFeed(stream, batches_per_epoch=5)
    assert list(feed.segment(0, 0, 5)) == [(0, 0), (0, 1), (0, 2)]
    assert list(feed.segment(1, 0, 5)) == [(1, 0), (1, 1), (1, 2)]
    assert stream.opened == [(0, 0)] and stream.made.count((1, 0)) == 1
