"""Evaluation between training segments as a GPU run has it (issue #43), held on CPU: under
the prefetch pipeline an evaluation's lookups lock no UVM cache slot, it scores in float32
(no autocast, no TF32) under every --precision and leaves the TF32 switches as they were,
and its batches are pinned where training's are. What only a GPU can show (the lock counts
inside an evaluation) is bench/gpu_check.py's ``cache_unlocked``."""

from __future__ import annotations

import pytest
import torch
from torchrec.datasets.utils import Batch

from checkpoint_runs import TINY
from torchrec_cloud import compat, train
from torchrec_cloud.build import build
from torchrec_cloud.config import parse_job_config
from torchrec_cloud.data.synthetic import SyntheticSource
from torchrec_cloud.distributed import init_distributed
from torchrec_cloud.evaluation import evaluate
from torchrec_cloud.metrics import MetricsSink
from torchrec_cloud.precision import PRECISIONS, pins_batches, precision_context


@pytest.fixture(scope="module")
def run_parts(tmp_path_factory):
    cfg = parse_job_config([*TINY, "--output_dir", str(tmp_path_factory.mktemp("run")), "--num_batches_per_epoch", "8"])
    env = init_distributed("gloo")  # a world of one in this process
    return env, build(cfg, env), SyntheticSource(cfg, 0, 1)


def _steps(trainer, source, first: int, count: int) -> None:
    """Training steps through the pipeline, drained at the end as the loop's segments are."""
    batches = (source.make_batch("train", i) for i in range(first, first + count))
    while True:
        try:
            trainer.pipeline.progress(batches)
        except StopIteration:
            return


@pytest.fixture
def tf32_as_before():
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


def test_an_evaluation_under_the_prefetch_pipeline_locks_no_cache_slot(run_parts):
    """fbgemm-gpu 1.8.0's TBE hands ``lock_cache_line`` to every ``lru_cache_populate`` of
    ``_prefetch`` (called inline by an evaluation's forward), and only a backward unlocks; so
    each evaluation forward must see it off, and training's must see it on again. On a CPU
    the TBEs have no cache: they are given the flag a ``prefetch_pipeline`` TBE has, and each
    forward records the flag its inline prefetch would read."""
    env, trainer, source = run_parts
    tbes = compat.table_batched_modules(trainer.dmp)
    assert tbes
    seen: list[tuple[bool, bool]] = []  # (an evaluation's forward, the lock its prefetch reads)

    def inline_prefetch(module, args):
        seen.append((not module.training, module.lock_cache_line))

    hooks = [tbe.register_forward_pre_hook(inline_prefetch) for tbe in tbes]
    for tbe in tbes:
        tbe.lock_cache_line = True
    try:
        _steps(trainer, source, 0, 2)
        train._evaluate(trainer, source, "val", 2, 0, env, MetricsSink(), {})
        _steps(trainer, source, 2, 2)  # the training pipeline attached again
    finally:
        for h in hooks:
            h.remove()
        for tbe in tbes:
            tbe.lock_cache_line = False
    evaluation = [lock for in_eval, lock in seen if in_eval]
    training = [lock for in_eval, lock in seen if not in_eval]
    assert len(evaluation) >= 4 * len(tbes), "every validation batch was looked up"
    assert not any(evaluation), "an evaluation forward's inline prefetch would lock cache slots"
    assert training and all(training), "training's prefetches lock their slots again"


@pytest.mark.parametrize("precision", PRECISIONS)
def test_an_evaluation_scores_in_float32_and_leaves_tf32_as_it_was(run_parts, precision, tf32_as_before):
    env, trainer, source = run_parts
    seen = []

    def over_arch(module, args, out):
        seen.append((torch.is_autocast_enabled("cpu"), torch.backends.cuda.matmul.allow_tf32,
                     torch.backends.cudnn.allow_tf32, out.dtype))  # fmt: skip

    model = trainer.dmp.module.model
    hook = model.over_arch.register_forward_hook(over_arch)
    step = precision_context(precision, env.device)
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    try:
        with step:  # an evaluation inside the step's context still scores in float32
            train._evaluate(trainer, source, "val", 0, 0, env, MetricsSink(), {})
    finally:
        hook.remove()
    assert seen and all(s == (False, False, False, torch.float32) for s in seen), seen
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == before
    if precision == "tf32":
        assert before == (True, True)


class _RecordedPin(Batch):
    pinned = 0

    def pin_memory(self) -> "Batch":
        _RecordedPin.pinned += 1
        return self


def test_evaluation_batches_are_pinned_where_training_batches_are(run_parts, monkeypatch):
    """On a GPU both training's and evaluation's batches are page-locked (their copies are
    ``non_blocking``); this CPU torch cannot page-lock, so each batch records its pin."""
    assert pins_batches(torch.device("cuda")) and not pins_batches(torch.device("cpu"))
    env, trainer, source = run_parts
    plain = source.eval_batches

    def recorded(split, rows=None):
        for batch, n in plain(split, rows):
            yield _RecordedPin(batch.dense_features, batch.sparse_features, batch.labels), n

    monkeypatch.setattr(source, "eval_batches", recorded)
    for pin, expected in ((None, 0), (True, 4)):  # None: as training on this device (a CPU)
        _RecordedPin.pinned = 0
        model = trainer.pipeline.detach()
        try:
            metrics = evaluate(model, trainer.optimizer, source, "val", env.device, pin=pin)
        finally:
            trainer.pipeline.attach(model)
        assert metrics["rows"] == 4 * 256
        assert _RecordedPin.pinned == expected
