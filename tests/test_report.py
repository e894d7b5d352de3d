"""``torchrec-cloud report`` on a real run's folder: PNGs that decode, a summary, clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from observed_run import observed_run

from torchrec_cloud.cli import main

PLOTS = ("loss.png", "auc.png", "samples_per_s.png")


def cli(capsys, *args: str) -> tuple[int, str, str]:
    """Run ``torchrec-cloud ARGS`` in this process: (exit code, stdout, stderr)."""
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A real run's folder (the shared short run of tests/observed_run.py), copied as "tiny"."""
    run = observed_run(tmp_path_factory)
    copy = tmp_path_factory.mktemp("report") / "tiny"
    shutil.copytree(run.output_dir, copy)
    return copy


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_report_writes_readable_plots_and_a_summary(run_dir: Path, tmp_path: Path, capsys) -> None:
    from PIL import Image

    out = tmp_path / "plots"
    code, stdout, stderr = cli(capsys, "report", str(run_dir), "--output", str(out))
    assert code == 0, stderr
    for name in PLOTS:
        path = out / name
        assert path.stat().st_size > 10_000, f"{name} is suspiciously small"
        with Image.open(path) as img:
            img.load()  # decodes the whole file
            assert 600 <= img.width <= 2000 and 300 <= img.height <= 1500, img.size
            gray = img.convert("L")
            # Curves, axes and text: a good share of pixels is not background white.
            dark = sum(gray.histogram()[:200])
            assert dark > 0.01 * img.width * img.height, f"{name} looks empty"
    recs = records(run_dir)
    test_auc = next(x["auc"] for x in recs if x.get("event") == "eval" and x.get("split") == "test")
    last_train = [x for x in recs if x.get("event") == "train"][-1]
    lines = stdout.splitlines()
    assert len(lines) <= 24, "the summary should fit one screen"
    row = next(line for line in lines if line.startswith("tiny "))
    assert f"{test_auc:.4f}" in row
    assert f"{last_train['loss']:.3f}" in row
    assert "finished" in stdout
    assert "of step time waiting for data" in stdout
    for name in PLOTS:
        assert str(out / name) in stdout


def test_default_output_is_next_to_the_run(run_dir: Path, tmp_path: Path, capsys) -> None:
    run = tmp_path / "copy"
    shutil.copytree(run_dir, run)
    code, _, stderr = cli(capsys, "report", str(run))
    assert code == 0, stderr
    assert sorted(p.name for p in (run / "report").iterdir()) == sorted(PLOTS)


def test_several_runs_are_overlaid(run_dir: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    second = tmp_path / "second"
    second.mkdir()
    # A second run that is the first one with every loss halved: the summary must tell them apart.
    with open(second / "metrics.jsonl", "w") as f:
        for rec in records(run_dir):
            if rec.get("event") == "train":
                rec["loss"] = rec["loss"] / 2
            f.write(json.dumps(rec) + "\n")
    monkeypatch.chdir(tmp_path)
    code, stdout, stderr = cli(capsys, "report", str(run_dir), str(second))
    assert code == 0, stderr
    rows = {line.split()[0]: line for line in stdout.splitlines() if line.split()[:1] in (["tiny"], ["second"])}
    assert set(rows) == {"tiny", "second"}
    assert rows["tiny"] != rows["second"]
    assert all((tmp_path / "report" / name).is_file() for name in PLOTS)


def test_folder_without_metrics_is_a_clear_error(tmp_path: Path, capsys) -> None:
    code, _, stderr = cli(capsys, "report", str(tmp_path))
    assert code == 2
    assert "no metrics.jsonl" in stderr and str(tmp_path) in stderr
    assert len(stderr.strip().splitlines()) == 1
    assert not (tmp_path / "report").exists()


def test_missing_folder_is_a_clear_error(tmp_path: Path, capsys) -> None:
    code, _, stderr = cli(capsys, "report", str(tmp_path / "nope"))
    assert code == 2
    assert "no such folder" in stderr


def test_run_without_records_yet_is_a_clear_error(tmp_path: Path, capsys) -> None:
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"event": "start", "world_size": 1}) + "\n")
    code, _, stderr = cli(capsys, "report", str(tmp_path))
    assert code == 2
    assert "no train or eval records" in stderr


def test_broken_line_is_reported_with_its_line_number(run_dir: Path, tmp_path: Path, capsys) -> None:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    lines.insert(3, '{"event": "train", "step": ')
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    code, _, stderr = cli(capsys, "report", str(tmp_path))
    assert code == 2
    assert f"{tmp_path / 'metrics.jsonl'}:4:" in stderr


def test_run_killed_mid_write_is_still_plotted(run_dir: Path, tmp_path: Path, capsys) -> None:
    text = (run_dir / "metrics.jsonl").read_text()
    (tmp_path / "metrics.jsonl").write_text(text + '{"event": "train", "st')
    code, stdout, stderr = cli(capsys, "report", str(tmp_path))
    assert code == 0, stderr
    assert "cut off" in stdout


def write_records(folder: Path, records: list[dict]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


def made_run(batch: int, ranks: list[int], spike: bool = False) -> list[dict]:
    """A run's records: ``ranks[i]`` ranks for the i-th 10 steps, a resume where it changes,
    a loss spike at the first record if asked, and one evaluation at the end."""
    records = [{"event": "start", "step": 0, "world_size": ranks[0], "config": {"data": {"batch_size": batch}},
                "bayes_auc": 0.82}]  # fmt: skip
    for i, world in enumerate(ranks):
        step = 10 * (i + 1)
        if i and world != ranks[i - 1]:
            records.append({"event": "resume", "step": step - 10, "world_size": world})
        loss = 76.4 if spike and i == 0 else 0.7 - 0.01 * i
        records.append({"event": "train", "step": step, "loss": loss, "samples_per_s": 1e4, "world_size": world})
    records.append({"event": "eval", "split": "val", "step": 10 * len(ranks), "auc": 0.8, "logloss": 0.5})
    return records


def test_a_loss_spike_stays_on_the_plot_without_flattening_it() -> None:
    from torchrec_cloud.report import _loss_cap

    values = [76.4] + [0.7 - 0.01 * i for i in range(20)]
    cap = _loss_cap(values)
    assert cap is not None and 0.7 < cap < 1.0  # the curve fills the axis; the spike sits on its edge
    assert _loss_cap([0.7 - 0.01 * i for i in range(20)]) is None  # nothing to clip


def test_runs_of_other_batch_sizes_and_resumes_are_drawn_against_samples(tmp_path: Path, capsys) -> None:
    from torchrec_cloud.report import _by_samples, load_run

    one = write_records(tmp_path / "one", made_run(8192, [1] * 6, spike=True))
    two = write_records(tmp_path / "two", made_run(2048, [2, 2, 2, 1, 1, 1]))
    runs = [load_run(one), load_run(two)]
    assert not _by_samples(runs[:1]) and _by_samples(runs)
    # 2 ranks x 2048 for 30 steps, then 1 rank after the resume.
    assert runs[1].samples_at([30, 60]) == [30 * 4096, 30 * 4096 + 30 * 2048]
    code, stdout, stderr = cli(capsys, "report", str(one), str(two), "--output", str(tmp_path / "plots"))
    assert code == 0, stderr
    assert "resumed 1x" in stdout
    assert all((tmp_path / "plots" / name).stat().st_size > 10_000 for name in PLOTS)


def test_val_and_test_labels_sit_by_their_own_points_and_the_gap_is_tests(tmp_path: Path, capsys) -> None:
    """A final test AUC above the validation AUC at the same step (the quickstart's case): each
    label is written beside its own point, named; the summary's Bayes column is the test
    split's, the one its gap is measured from."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from torchrec_cloud.report import _annotate_few

    _, ax = plt.subplots()
    _annotate_few(ax, {"val": [(200, 0.7957)], "test": [(200, 0.7973)]})
    labels = {t.get_text(): t.xyann[1] for t in ax.texts}
    plt.close("all")
    assert labels == {"val 0.7957": -14, "test 0.7973": 6}  # test above its point, val below its own

    records = [{"event": "start", "step": 0, "world_size": 1, "bayes_auc": 0.8143,
                "bayes_auc_by_split": {"val": 0.8143, "test": 0.8145}},
               {"event": "train", "step": 200, "loss": 0.5, "samples_per_s": 1e4},
               {"event": "eval", "split": "val", "step": 200, "auc": 0.7957, "bayes_auc": 0.8143},
               {"event": "eval", "split": "test", "step": 200, "auc": 0.7973, "bayes_auc": 0.8145},
               {"event": "end", "step": 200}]  # fmt: skip
    write_records(tmp_path / "q", records)
    code, out, err = cli(capsys, "report", str(tmp_path / "q"), "--output", str(tmp_path / "plots"))
    assert code == 0, err
    head, _, row = out.splitlines()[:3]
    assert head.split()[-4:] == ["test", "Bayes", "gap", "time"]
    assert row.split()[-4:-1] == ["0.7973", "0.8145", "0.0172"]  # test AUC, its Bayes, their gap
