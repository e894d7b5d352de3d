"""The private names we use from TorchRec, fbgemm and torch (compat.py) are where and what we
audited, on the pinned stack; one that moves switches its speed-ups off with a reason, or stops
a run at start-up naming it."""

import pytest
import torch

from helpers import with_speedups
from torchrec_cloud import compat
from torchrec_cloud.config import parse_job_config
from torchrec_cloud.model import build_model
from torchrec_cloud.speedups import Speedups

SMALL = ["--num_embeddings", "50", "--embedding_dim", "8", "--dense_arch_layer_sizes", "16,8",
         "--over_arch_layer_sizes", "16,1"]  # fmt: skip


@pytest.mark.parametrize("entry", compat.PRIVATE, ids=lambda e: e.name.split(" ")[0])
def test_every_private_name_is_as_audited(entry):
    entry.check()  # raises with what moved or changed
    assert entry.where.split(" ")[0].endswith(".py"), entry.where  # says which of our files relies on it


def test_the_start_up_check_passes_on_the_pinned_stack():
    assert compat.problems() == {}
    assert compat.check() == {}


def test_fingerprints_ignore_comments_and_docstrings_but_not_code():
    def documented():
        def f(x):
            """Doc."""
            return x + 1  # one

        return f

    def commented():
        def f(x):
            # another comment

            return x + 1

        return f

    def changed():
        def f(x):
            return x + 2

        return f

    assert compat.fingerprint(documented()) == compat.fingerprint(commented()) != compat.fingerprint(changed())


def test_a_changed_torchrec_forward_switches_its_speedup_off(monkeypatch):
    """As if TorchRec changed InteractionArch.forward: the dot interaction stays TorchRec's and
    the layer says why; the other speed-ups still apply, and the model gives the same result."""
    entry = next(e for e in compat.PRIVATE if e.name.startswith("torchrec.models.dlrm.InteractionArch"))
    monkeypatch.setattr(compat, "problems", lambda: {entry.name: "changed since audited: InteractionArch.forward"})
    with pytest.warns(RuntimeWarning, match="speed-up dot_interaction is off"):
        layer = Speedups.for_model(torch.device("cpu"))
    cfg = parse_job_config(SMALL)
    model = build_model(cfg.model, dense_device=torch.device("cpu"))
    layer.apply_to_model(model)
    assert "InteractionArch" in layer.not_applied["dot_interaction"]
    assert type(model.model.inter_arch).__name__ == "InteractionArch"  # TorchRec's own
    assert {"tables_first", "pooled_in_place", "bias_relu", "aligned_first_layers"} <= set(layer.applied)


def test_a_moved_core_name_stops_the_run_naming_it(monkeypatch):
    name = "torchrec DistributedModelParallel._dmp_wrapped_module"
    assert any(e.name == name for e in compat.PRIVATE)
    monkeypatch.setattr(compat, "problems", lambda: {name: "no longer sets self._dmp_wrapped_module"})
    with pytest.raises(compat.CompatError, match=r"_dmp_wrapped_module .*distributed\.py.*requirements/stack\.txt"):
        compat.check()


def test_an_unaudited_stack_runs_changed_sources_but_never_missing_names(monkeypatch, capsys):
    """bench/gpu_device_run.sh measures on the stack a GPU machine has offline: a core name
    whose source changed runs as it is when TORCHREC_CLOUD_UNAUDITED_STACK=1 (and says so); a
    name that is gone stops the run all the same; without the variable both stop it."""
    name = "torchrec DistributedModelParallel._dmp_wrapped_module"
    changed = {name: "changed since audited: DistributedModelParallel.__init__ (1, audited 2)"}
    monkeypatch.setattr(compat, "problems", lambda: changed)
    with pytest.raises(compat.CompatError, match="_dmp_wrapped_module"):
        compat.check()
    monkeypatch.setenv(compat.UNAUDITED_ENV, "1")
    assert compat.check() == {}
    assert f"{compat.UNAUDITED_ENV}=1: running {name} unaudited" in capsys.readouterr().err
    monkeypatch.setattr(compat, "problems", lambda: {name: "no longer sets self._dmp_wrapped_module"})
    with pytest.raises(compat.CompatError, match="_dmp_wrapped_module"):
        compat.check()


def test_accessors_reach_what_they_name():
    # DCP's fsspec file system, subclassed as checkpoint/dcp.py does
    assert hasattr(compat.fsspec_filesystem(), "init_path")
    shard, sharded = compat.sharded_tensor_types()
    assert shard.__name__ == "Shard" and sharded.__name__ == "ShardedTensor"
    stager = compat.already_staged()
    assert stager.should_synchronize_after_execute is False and stager.stage({"a": 1}) == {"a": 1}
    model = with_speedups(build_model(parse_job_config(SMALL).model, dense_device=torch.device("cpu")))

    class FakeDMP:  # what distributed._DataParallelAcrossRanks hands it
        _dmp_wrapped_module = model

    assert compat.wrapped_module(FakeDMP()) is model
    # compat.sharded_tensor_like and compat.load_whole run on real checkpoints in
    # test_checkpoint.py (asynchronous saves; load_full_state).
