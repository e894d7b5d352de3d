"""``export --format torchscript,pt2`` and ``export --publish ROOT``: the AOTInductor package
scores a batch of one row and bags of no ids as TorchScript and TorchRec do, the loader picks
the runtime a folder can serve with, and publishing a version never lets ``current`` name a
folder that is not complete. One tiny checkpoint, one pt2 compile for the whole module (a
C++ build: the slow part)."""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from checkpoint_runs import TINY
from test_bad_inputs import cli_error
from torchrec_cloud import cli
from torchrec_cloud.config import parse_job_config
from torchrec_cloud.serving import ServingError, read_model_config, saved_job_config
from torchrec_cloud.serving.publish import CURRENT_FILE, current_model, read_current
from torchrec_cloud.serving.runtime import load_scorer
from torchrec_cloud.train import run as train

SMALL = [*TINY, "--num_embeddings", "50", "--embedding_dim", "4", "--num_sparse_features", "3",
         "--num_dense_features", "2", "--dense_arch_layer_sizes", "8,4", "--over_arch_layer_sizes", "8,1",
         "--num_batches_per_epoch", "3"]  # fmt: skip


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A tiny 1-rank run's checkpoint, exported with the default formats (both)."""
    root = tmp_path_factory.mktemp("pt2")
    train(parse_job_config([*SMALL, "--output_dir", str(root / "run"), "--checkpoint_path", str(root / "ckpt")]))
    assert cli.main(["export", str(root / "ckpt"), "--output", str(root / "model")]) == 0
    return root


def torchrec_logits(model_dir: Path, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """TorchRec's own DLRM, built from the folder's config and its unsharded weights.pt."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from torchrec_cloud.model import build_model

    cfg = saved_job_config(read_model_config(str(model_dir)), "model_config.json").model
    model = build_model(cfg, dense_device=torch.device("cpu"))
    model.load_state_dict(torch.load(model_dir / "weights.pt", weights_only=True), assign=True)
    kjt = KeyedJaggedTensor(keys=cfg.sparse_names, values=values, lengths=lengths, stride=dense.shape[0])
    with torch.no_grad():
        return model.eval().model(dense, kjt).view(-1)


def batches() -> list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """A row of empty bags, a row of one id each, and rows mixing empty and full bags."""
    g = torch.Generator().manual_seed(7)
    out = []
    for name, b, lengths in (("one row, empty bags", 1, torch.zeros(3, dtype=torch.int64)),
                             ("one row, one id a bag", 1, torch.ones(3, dtype=torch.int64)),
                             ("five rows, 0 to 3 ids a bag", 5, torch.randint(0, 4, (15,), generator=g))):  # fmt: skip
        values = torch.randint(0, 50, (int(lengths.sum()),), generator=g)
        out.append((name, torch.rand(b, 2, generator=g), values, lengths))
    return out


def test_pt2_scores_one_row_and_empty_bags_as_torchrec_and_torchscript(work):
    model = work / "model"
    assert (model / "scorer.pt2").is_file() and (model / "scorer.pt").is_file()
    pt2, scripted = load_scorer(str(model)), load_scorer(str(model), runtime="torchscript")
    assert (pt2.runtime, scripted.runtime) == ("pt2", "torchscript")  # auto prefers the package
    for name, dense, values, lengths in batches():
        expected = torchrec_logits(model, dense, values, lengths)
        got = pt2.logits_of_bags(dense, values, lengths)
        assert got.shape == (dense.shape[0],), name
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(scripted.logits_of_bags(dense, values, lengths), expected, rtol=1e-5, atol=1e-6, msg=name)
    # predict's lengths come as int32 from a KeyedJaggedTensor: the loader takes them too
    name, dense, values, lengths = batches()[2]
    torch.testing.assert_close(pt2.logits_of_bags(dense, values.int(), lengths.int()), scripted.logits_of_bags(dense, values, lengths))


def test_the_packages_pooling_sums_and_averages_bags_as_torchscripts_does():
    """The pt2 program pools bags with embedding_bag (Tables.bag_op; AOTInductor compiles the
    TorchScript module's index_add_ to atomic adds): the same pooled embeddings, sum and mean
    tables, empty bags, one to three ids a bag; quantized tables keep the one way."""
    from torchrec_cloud.serving.scorer import Tables

    g = torch.Generator().manual_seed(3)
    tables = [torch.randn(n, 8, generator=g) for n in (5, 9, 3)]
    for quantize in ("none", "fp16", "int8"):
        module = Tables(tables, quantize, mean=[False, True, False])
        for b in (1, 4):
            lengths = torch.randint(0, 4, (3 * b,), generator=g)
            lengths[0] = 0  # an empty bag in a mean table too
            lengths[b] = 0
            per_table = lengths.view(3, b).sum(dim=1).tolist()
            values = torch.cat([torch.randint(0, t.shape[0], (int(k),), generator=g) for t, k in zip(tables, per_table)])
            module.bag_op = False
            expected = module(values, lengths, b)
            module.bag_op = True
            torch.testing.assert_close(module(values, lengths, b), expected, rtol=1e-6, atol=1e-6)
            assert expected.shape == (b, 3, 8) and not expected[0, 0].any() and not expected[0, 1].any()


@pytest.fixture
def fresh_tmpdir(tmp_path, monkeypatch) -> Path:
    """A temporary directory of the test's own, for torch's C++ (which reads $TMPDIR) and for
    Python's tempfile (which read it once)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    return tmp


def test_pt2_loads_leave_no_extracted_package_behind(work, fresh_tmpdir):
    """torch extracts a package into $TMPDIR/aotinductor_XXXXXX and removes it only when the
    loaded model is collected, which a worker that ends abruptly never does: one folder (the
    library with the weights) left per load and version swap. The loader removes it at once,
    two loads at the same time each their own, and leaves another process's folder alone."""
    other = fresh_tmpdir / "aotinductor_AbCdEf"  # another worker's, loading
    other.mkdir()
    (other / "wrapper.so").write_bytes(b"not ours")
    model = str(work / "model")
    with ThreadPoolExecutor(2) as pool:
        loads = [pool.submit(load_scorer, model, runtime="pt2") for _ in range(2)]
        scorers = [f.result() for f in loads]
    left = sorted(p.name for p in fresh_tmpdir.iterdir() if not p.name.startswith("torchinductor_"))
    assert left == [other.name] and (other / "wrapper.so").read_bytes() == b"not ours"
    for name, dense, values, lengths in batches():  # the library is still mapped: they score
        expected = torchrec_logits(work / "model", dense, values, lengths)
        for scorer in scorers:
            torch.testing.assert_close(scorer.logits_of_bags(dense, values, lengths), expected, rtol=1e-5, atol=1e-6, msg=name)


def test_where_kernels_are_read_later_only_the_mapped_library_goes(work, fresh_tmpdir):
    """A CUDA package reads its kernels from the folder at their first launch: there only the
    mapped library is removed (the same step on this CPU package), and the model still scores."""
    from torch._inductor import aoti_load_package

    from torchrec_cloud.serving import runtime

    before = runtime._mapped_files()
    module = aoti_load_package(str(work / "model" / "scorer.pt2"))
    runtime._remove_extracted(runtime._mapped_files(), before, whole_folder=False)
    [folder] = fresh_tmpdir.glob("aotinductor_*")
    left = [p.name for p in folder.rglob("*") if p.is_file()]
    assert left and not [n for n in left if n.endswith(".so")]
    name, dense, values, lengths = batches()[2]
    with torch.no_grad():
        got = module(dense, values, lengths)
    torch.testing.assert_close(got, torchrec_logits(work / "model", dense, values, lengths), rtol=1e-5, atol=1e-6)


def edited_copy(work: Path, tmp_path: Path, edit) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(work / "model", folder)
    config = json.loads((folder / "model_config.json").read_text())
    edit(config, folder)
    (folder / "model_config.json").write_text(json.dumps(config))
    return folder


def test_auto_falls_back_to_torchscript_for_a_package_it_cannot_load(work, tmp_path):
    def other_torch(config, folder):
        config["pt2"]["torch"] = "2.99.0"

    folder = edited_copy(work, tmp_path, other_torch)
    assert load_scorer(str(folder)).runtime == "torchscript"
    with pytest.raises(ServingError, match="compiled by torch 2.99.0"):
        load_scorer(str(folder), runtime="pt2")


def test_a_damaged_package_is_one_clear_error(work, tmp_path):
    def garbage(config, folder):
        size = (folder / "scorer.pt2").stat().st_size
        (folder / "scorer.pt2").write_bytes(b"\0" * size)

    folder = edited_copy(work, tmp_path, garbage)
    with pytest.raises(ServingError, match="scorer.pt2 is not a loadable AOTInductor package"):
        load_scorer(str(folder), runtime="pt2")

    def longer(config, folder):
        with open(folder / "scorer.pt2", "ab") as f:
            f.write(b"x")

    folder = edited_copy(work, tmp_path / "b", longer)
    with pytest.raises(ServingError, match="altered or truncated"):
        load_scorer(str(folder))


def test_format_chooses_the_scorers_written(work, tmp_path, capsys):
    assert cli.main(["export", str(work / "ckpt"), "--output", str(tmp_path / "ts"), "--format", "torchscript"]) == 0
    assert not (tmp_path / "ts" / "scorer.pt2").exists()
    assert load_scorer(str(tmp_path / "ts")).runtime == "torchscript"
    with pytest.raises(ServingError, match="has no scorer.pt2"):
        load_scorer(str(tmp_path / "ts"), runtime="pt2")
    cli_error(capsys, 2, ["export", str(work / "ckpt"), "--output", str(tmp_path / "x"), "--format", "onnx"], "--format")
    cli_error(capsys, 2, ["export", str(work / "ckpt"), "--format", "torchscript"], "--output", "--publish")


def test_publish_writes_versions_and_current_never_names_an_incomplete_one(work, tmp_path):
    root = tmp_path / "root"
    assert cli.main(["export", str(work / "ckpt"), "--publish", str(root), "--format", "torchscript"]) == 0
    first = read_current(str(root))
    assert (root / CURRENT_FILE).read_text() == first + "\n"
    first_config = read_model_config(str(root / first))
    assert first_config["lineage"]["parent"] is None and first_config["lineage"]["checkpoint"]["step"] == 3

    seen: list[str] = []
    stop = threading.Event()

    def watch() -> None:  # what a server following ROOT/current would load, while a publish runs
        while not stop.is_set():
            folder = current_model(str(root))
            read_model_config(folder)  # complete: its config is written last
            seen.append(folder)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        assert cli.main(["export", str(work / "ckpt"), "--publish", str(root), "--format", "torchscript"]) == 0
    finally:
        stop.set()
        watcher.join()
    second = read_current(str(root))
    assert second != first and sorted([first, second]) == [first, second]  # names sort as published
    assert read_model_config(str(root / second))["lineage"]["parent"] == first
    assert (root / first / "scorer.pt").is_file()  # the old version is left as it was
    assert sorted(p.name for p in root.iterdir()) == sorted([first, second, CURRENT_FILE])  # no temporary left
    assert set(seen) <= {str(root / first), str(root / second)}
    scorer = load_scorer(current_model(str(root)))
    name, dense, values, lengths = batches()[0]
    torch.testing.assert_close(scorer.logits_of_bags(dense, values, lengths), torchrec_logits(root / second, dense, values, lengths))


def test_a_failed_publish_leaves_current_as_it_was(work, tmp_path, capsys):
    root = tmp_path / "root"
    assert cli.main(["export", str(work / "ckpt"), "--publish", str(root), "--format", "torchscript"]) == 0
    before = (root / CURRENT_FILE).read_text()
    # the checkpoint's dataset is not there: the export stops after the model is read
    cli_error(capsys, 1, ["export", str(work / "ckpt"), "--publish", str(root), "--format", "torchscript",
                          "--dataset_path", str(tmp_path / "no-such-dataset")], "no-such-dataset")  # fmt: skip
    assert (root / CURRENT_FILE).read_text() == before
    assert sorted(p.name for p in root.iterdir()) == sorted([before.strip(), CURRENT_FILE])


def test_a_dcn_model_torchscript_cannot_compile_serves_from_its_package(tmp_path, capsys):
    """DCNv2's CrossNet indexes its layers with a loop variable, which TorchScript refuses:
    the default export says so in one note and writes the package, which scores as TorchRec."""
    train(parse_job_config([*SMALL, "--interaction", "dcn", "--num_batches_per_epoch", "2",
                            "--output_dir", str(tmp_path / "run"), "--checkpoint_path", str(tmp_path / "ckpt")]))  # fmt: skip
    capsys.readouterr()
    assert cli.main(["export", str(tmp_path / "ckpt"), "--output", str(tmp_path / "model")]) == 0
    assert "note: no scorer.pt, the pt2 package serves" in capsys.readouterr().err
    assert not (tmp_path / "model" / "scorer.pt").exists()
    assert not (tmp_path / "model" / "tables.pt").exists()  # mapped only in place of scorer.pt's tables
    scorer = load_scorer(str(tmp_path / "model"))
    assert scorer.runtime == "pt2"
    for name, dense, values, lengths in batches():
        expected = torchrec_logits(tmp_path / "model", dense, values, lengths)
        torch.testing.assert_close(scorer.logits_of_bags(dense, values, lengths), expected, rtol=1e-5, atol=1e-6, msg=name)
    cli_error(capsys, 1, ["export", str(tmp_path / "ckpt"), "--output", str(tmp_path / "ts"), "--format", "torchscript"],
              "cannot build scorer.pt")  # fmt: skip
