"""Our own collectives are valid on every backend by construction (comm.py).

On GPUs the default process group is NCCL, which has no backend for CPU tensors. Two
ranks here get a default group with the same property (a backend registered for CUDA
tensors only) and run every function of comm.py and the code that issues them; and no
module issues a collective anywhere else.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from helpers import REPO, torchrun

# The CPU speed-ups' shared-memory process group implements collectives; it is a backend
# for CPU ranks on one host, not a caller of one.
ALLOWED = {"comm.py", "shm_group.py"}
COLLECTIVE = re.compile(
    r"\bdist\.(all_reduce|all_gather|all_gather_object|all_gather_into_tensor|all_to_all|all_to_all_single|"
    r"broadcast|broadcast_object_list|barrier|monitored_barrier|reduce|reduce_scatter|gather|gather_object|"
    r"scatter|scatter_object_list|send|recv|isend|irecv|new_group)\("
)


def test_every_collective_of_ours_works_where_the_default_group_rejects_cpu_tensors(tmp_path):
    proc = torchrun(2, [str(REPO / "tests" / "strict_world_worker.py"), str(tmp_path)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in results:
        assert r["world_rejects_cpu"] is True, "the strict world must refuse a CPU tensor, as NCCL does"
        assert r["min"] == [1, 4]
        assert r["mean"] == 1.5
        assert r["max"] == 10.0
        assert r["gathered"] == [0.0, 1.0, 100.0, 101.0, 102.0]
        assert r["sum"] == [3, 2**41]
        assert r["objects"] == [{"rank": 0}, {"rank": 1}]
        assert r["broadcast"] == "from 1"
        assert r["agreed_from_rank0"] == "found by rank 0"
        assert r["batches"] == [0, 1, 2], "both ranks stop when one runs out"
        assert r["after_sigterm"] == [] and r["stopped"] is True, "a SIGTERM on rank 0 stops rank 1 too"
        assert r["train_loss"] == 1.5
        assert r["resume_target"] is None and r["async_group"] is True
        # Exact: the AUC of both ranks' rows is that of the whole, to the last bit.
        assert r["across"]["auc"] == r["whole"]["auc"]
        assert r["whole"]["auc"] == pytest.approx(r["torchmetrics_auc"], abs=1e-6)  # it sums in float32
        assert r["across"]["rows"] == 1000 and r["across"]["logloss"] == pytest.approx(r["whole"]["logloss"], rel=1e-12)
        assert r["across"]["ne"] == pytest.approx(r["whole"]["ne"], rel=1e-12)
    # Rank r received from each rank the rows sent to r, in rank order.
    assert results[0]["exchanged"] == [[0.0, 1.0], [10.0, 11.0]]
    assert results[1]["exchanged"] == [[2.0, 3.0], [4.0, 5.0], [12.0, 13.0], [14.0, 15.0]]
    # No rank held the split: each held the distinct scores of its own range, together all of them.
    low, high = results[0]["held"], results[1]["held"]
    assert low and high and max(low) < min(high)
    assert len(low) + len(high) == results[0]["distinct"]


def test_no_module_issues_a_collective_outside_comm():
    offenders = []
    for path in sorted((REPO / "src" / "torchrec_cloud").rglob("*.py")):
        if path.name in ALLOWED:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if COLLECTIVE.search(line):
                offenders.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not offenders, "collectives belong in comm.py:\n" + "\n".join(offenders)
