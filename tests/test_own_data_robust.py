"""Your own data, crafted to break things (issue 39): what a worker decodes is bounded by caps
whatever the file's encoding, dense values are finite or refused, column names and schema keys
cannot inject anything, and every damaged input ends in one line with a non-zero exit.

Small files are written per test; one module-scoped model (preprocessed, trained on one
process for a few steps, exported) serves the `predict` tests."""

from __future__ import annotations

import json
import os
import resource
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers import PYTHON, cli, env_for_subprocess, explain, run
from torchrec_cloud.cli import main
from torchrec_cloud.data.events_gen import DAY_S, SCHEMA, START, write_events

ROWS = 40
SMALL = """
name: t
label: {column: clicked}
dense:
  - {name: price, transform: standardize}
sparse:
  - {name: user, type: string, mapping: vocab, num_embeddings: 100}
  - {name: tags, type: int, list: true, mapping: vocab, num_embeddings: 100}
"""


def one_line_error(capsys, *argv: str) -> str:
    """The one line a command ends with: exit non-zero, no traceback."""
    rc, out, err = cli(capsys, *argv)
    assert rc != 0 and "Traceback" not in err, (rc, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def table(n: int = ROWS, **columns) -> pa.Table:
    data = {"clicked": [i % 2 for i in range(n)], "price": [float(i) for i in range(n)],
            "user": [f"u{i % 5}" for i in range(n)], "tags": [[i % 3] for i in range(n)]}  # fmt: skip
    data.update(columns)
    return pa.table(data)


@pytest.fixture
def small(tmp_path) -> Path:
    (tmp_path / "s.yaml").write_text(SMALL)
    return tmp_path


def preprocess(d: Path, name: str, *extra: str) -> list[str]:
    return ["data", "preprocess", "--no_progress", "--workers", "1", "--schema", str(d / "s.yaml"), "--input",
            str(d / name), "--output", str(d / f"out-{name}"), *extra]  # fmt: skip


# ---------------------------------------------------------------------------------------
# Finding 2: memory bounded by what is decoded.


def _limited(limit_gib: float, argv: list[str]) -> subprocess.CompletedProcess:
    """``torchrec-cloud ARGV`` in a process whose address space is capped at ``limit_gib``."""
    limit = int(limit_gib * (1 << 30))
    # Fewer threads and malloc arenas: the address space a process reserves beside its data
    # then depends less on the machine's cores.
    env = dict(env_for_subprocess(), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MALLOC_ARENA_MAX="2")
    return subprocess.run([PYTHON, "-m", "torchrec_cloud", *argv], env=env, capture_output=True,
                          text=True, timeout=300, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)))  # fmt: skip


@pytest.mark.parametrize("case", ["run_length_list", "long_id"])
def test_a_row_that_decodes_big_is_refused_in_bounded_memory(small, case):
    """A 2 KB file whose one list holds 3 x 10^7 zeros (run-length encoded), or an 8 KB zstd
    file holding one 200 MB id: one bad row naming FILE:ROW, the column and the cap, under an
    address-space limit that the same file overflows once the cap is lifted (before the caps,
    10^7 zeros took 1 GB and the id 2.3 GB)."""
    if case == "run_length_list":
        offsets = np.arange(ROWS + 1, dtype=np.int32)
        offsets[4:] += 30_000_000 - 1  # row 4 (1-based) holds 3 x 10^7 ids
        tags = pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.zeros(int(offsets[-1]), np.int64)))
        pq.write_table(table(tags=tags), small / "f.parquet")
        column, lift, limit = "tags", ["--max_list_length", "100000000"], 2.2
    else:
        users = pa.array(["x" * 200_000_000 if i == 3 else f"u{i % 5}" for i in range(ROWS)])
        pq.write_table(table(user=users), small / "f.parquet", compression="zstd")
        del users
        column, lift, limit = "user", ["--max_id_bytes", str(1 << 30)], 3.6
    assert (small / "f.parquet").stat().st_size < 20_000
    proc = _limited(limit, preprocess(small, "f.parquet"))
    assert proc.returncode == 1, explain(proc)
    line = proc.stderr.strip().splitlines()[-1]
    assert "Traceback" not in proc.stderr and f"f.parquet:4: column {column}: " in line and "--max_" in line, proc.stderr
    skipped = _limited(limit, preprocess(small, "f.parquet", "--on_bad_line", "skip", "--output", str(small / "o2")))
    assert skipped.returncode == 0, explain(skipped)
    manifest = json.loads((small / "o2" / "manifest.json").read_text())
    assert manifest["rows"] == ROWS - 1 and manifest["skipped_rows"] == 1
    lifted = _limited(limit, preprocess(small, "f.parquet", *lift, "--output", str(small / "o3")))
    assert lifted.returncode != 0 and "Memory" in lifted.stderr, explain(lifted)  # the limit bites without the cap


def test_a_row_group_over_the_decoded_caps_is_refused_before_it_is_read(small, capsys, monkeypatch):
    from torchrec_cloud.data import tabular

    pq.write_table(table(), small / "f.parquet")
    monkeypatch.setattr(tabular, "MAX_GROUP_VALUES", ROWS - 1)
    line = one_line_error(capsys, *preprocess(small, "f.parquet"))
    assert "row group 0, column " in line and "write it with smaller row groups" in line


def test_caps_apply_to_csv_rows_and_keep_line_numbers(small, capsys):
    rows = [f"{i % 2},{i},{'y' * 5000 if i == 6 else f'u{i % 5}'},{i % 3}" for i in range(ROWS)]
    rows.insert(3, "1,2")  # a short line before it, left out too
    (small / "f.csv").write_text("clicked,price,user,tags\n" + "\n".join(rows) + "\n")
    line = one_line_error(capsys, *preprocess(small, "f.csv", "--on_bad_line", "error"))
    assert "f.csv:5: expected 4 fields" in line
    rc, out, err = cli(capsys, *preprocess(small, "f.csv", "--on_bad_line", "skip"))
    assert rc == 0, err
    assert "f.csv:9: column user: a value of 5000 bytes, more than --max_id_bytes 4096" in out
    manifest = json.loads((small / "out-f.csv" / "manifest.json").read_text())
    assert manifest["rows"] == ROWS - 1 and manifest["skipped_rows"] == 2


# ---------------------------------------------------------------------------------------
# Finding 3: finite or refused.


def test_inf_in_parquet_and_csv_is_a_bad_row(small, capsys):
    pq.write_table(table(price=[float("inf") if i == 7 else float(i) for i in range(ROWS)]), small / "f.parquet")
    line = one_line_error(capsys, *preprocess(small, "f.parquet"))
    assert "f.parquet:8: column price: inf is not a finite number" in line
    for text in ("inf", "Infinity", "-INF"):
        values = [text if i == 3 else str(i) for i in range(ROWS)]
        (small / "f.csv").write_text("clicked,price,user,tags\n" + "".join(f"{i % 2},{v},u{i % 5},{i % 3}\n" for i, v in enumerate(values)))
        line = one_line_error(capsys, *preprocess(small, "f.csv", "--output", str(small / text)))
        assert "f.csv:5: column price: " in line and "not a finite number" in line, line
    rc, out, err = cli(capsys, *preprocess(small, "f.parquet", "--on_bad_line", "skip"))
    assert rc == 0, err
    manifest = json.loads((small / "out-f.parquet" / "manifest.json").read_text())
    assert manifest["skipped_rows"] == 1 and np.isfinite(manifest["transforms"]["dense_stats"]["price"]["std"])


def test_train_stops_on_a_non_finite_loss_and_keeps_the_last_good_checkpoint(tmp_path):
    """A learning rate that blows the weights up at the first update: step 2's loss is NaN."""
    from helpers import TINY

    proc = run([PYTHON, "-m", "torchrec_cloud", "train", *TINY, "--learning_rate", "1e30", "--log_every", "1",
                "--checkpoint_path", str(tmp_path / "ck"), "--checkpoint_interval", "1", "--output_dir", str(tmp_path / "run")])  # fmt: skip
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, explain(proc)
    assert proc.stderr.strip().splitlines()[-1].startswith("torchrec-cloud train: error: step 2: the training loss is not finite")
    assert sorted(p.name for p in (tmp_path / "ck").glob("step_*")) == ["step_00000001"]


# ---------------------------------------------------------------------------------------
# Findings 4 and 5: names and keys.


def test_a_column_name_cannot_inject_schema_keys(tmp_path, capsys):
    from torchrec_cloud.data.schema import load_schema

    injected = "meta\nlabel: {column: views, threshold: 0}\n#"
    n = 50
    pq.write_table(pa.table({"clicked": [i % 2 for i in range(n)], "views": list(range(n)), "user": [f"u{i % 7}" for i in range(n)],
                             injected: pa.array([{"a": i} for i in range(n)]),
                             "\x1b[31mred": pa.array([{"b": i} for i in range(n)])}), tmp_path / "f.parquet")  # fmt: skip
    rc, out, err = cli(capsys, "data", "schema", "--input", str(tmp_path / "f.parquet"), "--output", str(tmp_path / "s.yaml"))
    assert rc == 0, err
    text = (tmp_path / "s.yaml").read_text()
    assert "\x1b" not in text + out + err and "meta\\nlabel: {column: views" in text
    schema = load_schema(str(tmp_path / "s.yaml"))
    assert schema.label.column == "clicked" and schema.label.threshold is None
    # No label found: the proposal goes to the terminal, names and all.
    pq.write_table(pq.read_table(tmp_path / "f.parquet").drop_columns(["clicked"]), tmp_path / "g.parquet")
    rc, out, err = cli(capsys, "data", "schema", "--input", str(tmp_path / "g.parquet"))
    assert rc == 0 and "CHANGE_ME" in out, err
    assert "\x1b" not in out + err and "\\x1b[31mred" in out


def test_a_schema_with_a_key_given_twice_is_refused(small, capsys):
    pq.write_table(table(), small / "f.parquet")
    (small / "s.yaml").write_text(SMALL + "label: {column: price, threshold: 0}\n")
    line = one_line_error(capsys, *preprocess(small, "f.parquet"))
    assert "s.yaml" in line and "the key label is given twice" in line


def test_duplicate_column_names_are_refused(small, capsys):
    t = table()
    pq.write_table(t.append_column("user_2", t.column("price")).rename_columns(["clicked", "price", "user", "tags", "user"]),
                   small / "f.parquet")  # fmt: skip
    (small / "f.csv").write_text("user,clicked,price,user,tags\n" + "".join(f"{i},{i % 2},{i},u{i % 5},{i % 3}\n" for i in range(ROWS)))
    for name in ("f.parquet", "f.csv"):
        line = one_line_error(capsys, *preprocess(small, name))
        assert "the column name user is given twice" in line
        line = one_line_error(capsys, "data", "schema", "--input", str(small / name))
        assert "the column name user is given twice" in line


# ---------------------------------------------------------------------------------------
# Finding 6: one line, never a traceback.


@pytest.mark.parametrize("edit, expected", [
    (("split: {by: ts, val_from: 2024-13-45, test_from: 2024-12-01}\n", None), "give an ISO date"),
    (("split: {by: num, val_from: 2024-13-45, test_from: 2024-12-01}\n", None), "give a number"),
    (("", "num_embeddings: 100}"), "Exceeds the limit (4300 digits)"),
    (("header: !!bool maybe\n", None), "cannot convert ('maybe')"),
    (("split: {by: ts, val_from: !!timestamp 2024-13-45, test_from: x}\n", None), "month must be in 1..12"),
])  # fmt: skip
def test_schema_values_that_do_not_convert_end_in_one_line(small, capsys, edit, expected):
    add, replace = edit
    text = SMALL + add
    if replace:
        text = text.replace(replace, "num_embeddings: " + "9" * 5000 + "}", 1)
    (small / "s.yaml").write_text(text)
    ts = pa.array(np.arange(ROWS) * 86_400_000_000 + 1_700_000_000_000_000, pa.timestamp("us"))
    pq.write_table(table(ts=ts, num=list(range(ROWS))), small / "f.parquet")
    line = one_line_error(capsys, *preprocess(small, "f.parquet"))
    assert expected in line, line


def test_a_schema_over_1_mib_is_refused_and_the_c_loader_is_used(small, capsys):
    import yaml

    from torchrec_cloud.untrusted import yaml_parser

    assert yaml_parser() == ("libyaml" if yaml.__with_libyaml__ else "python")
    (small / "s.yaml").write_text(SMALL + "#" * (1 << 20) + "\n")
    pq.write_table(table(), small / "f.parquet")
    assert "holds more than 1048576 bytes" in one_line_error(capsys, *preprocess(small, "f.parquet"))


def _damaged_parquets(d: Path) -> list[Path]:
    pq.write_table(table(), d / "good.parquet")
    data = (d / "good.parquet").read_bytes()
    out = {"empty.parquet": b"", "text.parquet": b"clicked,price\n1,2\n",
           "footer_length.parquet": data[:-8] + struct.pack("<I", 1 << 30) + b"PAR1",
           "footer_bytes.parquet": data[:-60] + b"\xff" * 52 + data[-8:]}  # fmt: skip
    for name, content in out.items():
        (d / name).write_bytes(content)
    return [d / name for name in out]


def test_damaged_parquet_files_end_in_one_line(small, capsys):
    for path in _damaged_parquets(small):
        line = one_line_error(capsys, *preprocess(small, path.name))
        assert path.name in line, line
        line = one_line_error(capsys, "data", "schema", "--input", str(path))
        assert path.name in line, line


def test_a_list_column_cannot_split_rows(small, capsys):
    pq.write_table(table(), small / "f.parquet")
    for by in ("tags", "hash:tags"):
        line = one_line_error(capsys, *preprocess(small, "f.parquet", "--split_by", by, "--val_from", "0.8", "--test_from", "0.9",
                                                  "--output", str(small / by.replace(":", "_"))))  # fmt: skip
        assert "column tags holds list" in line and "the split's key" in line, line


def test_csv_integer_ids_with_spaces_or_signs_count_as_the_encoder_reads_them(small, capsys):
    written = [" 5", "+7", "5", "7"]
    (small / "f.csv").write_text("clicked,price,user,tags\n" + "".join(f"{i % 2},{i},u{i % 5},{written[i % 4]}\n" for i in range(ROWS)))
    rc, out, err = cli(capsys, *preprocess(small, "f.csv", "--split_by", "price", "--val_from", str(ROWS), "--test_from", str(ROWS + 1)))
    assert rc == 0, err
    vocab = json.loads((small / "out-f.csv" / "vocab" / "tags.json").read_text())["values"]
    assert sorted(vocab) == [5, 7]


def test_a_counts_file_mixing_int_and_string_ids_is_refused(small, capsys):
    pq.write_table(table(), small / "f.parquet")
    counts = small / "out-f.parquet" / "_counts"
    counts.mkdir(parents=True)
    doc = {"input": str(small / "f.parquet"), "train_rows": 3, "moments": {"price": [3, 1.0, 2.0]},
           "ids": {"user": {"values": ["u1", "u2"], "counts": [1, 1]}, "tags": {"values": [1, "1"], "counts": [1, 1]}}}  # fmt: skip
    (counts / "00000-f.json").write_text(json.dumps(doc))
    line = one_line_error(capsys, *preprocess(small, "f.parquet"))
    assert "00000-f.json: ids.tags: an id must be an integer (type: int)" in line, line


# ---------------------------------------------------------------------------------------
# predict: bad rows, damaged files, a damaged model folder, JSON without NaN.


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """Events preprocessed (3 days: train, val, test), trained a few steps on one process, exported."""
    root = tmp_path_factory.mktemp("robust")
    write_events(str(root / "events"), days=3, rows_per_day=300, seed=1)
    (root / "schema.yaml").write_text(SCHEMA)
    assert main(["data", "preprocess", "--no_progress", "--workers", "1", "--schema", str(root / "schema.yaml"), "--input",
                 str(root / "events"), "--output", str(root / "data"), "--split_by", "ts", "--val_from",
                 str(START + DAY_S), "--test_from", str(START + 2 * DAY_S)]) == 0  # fmt: skip
    proc = run([PYTHON, "-m", "torchrec_cloud", "train", "--dataset_path", str(root / "data"), "--embedding_dim", "8",
                "--dense_arch_layer_sizes", "16,8", "--over_arch_layer_sizes", "16,1", "--batch_size", "100",
                "--no-progress", "--no-tensorboard", "--eval_every", "0", "--checkpoint_path", str(root / "ck"),
                "--output_dir", str(root / "run")])  # fmt: skip
    assert proc.returncode == 0, explain(proc)
    assert main(["export", str(root / "ck"), "--output", str(root / "model")]) == 0
    return root


def test_predict_refuses_or_skips_a_value_that_overflows_after_its_transform(model, capsys, tmp_path):
    t = pq.read_table(model / "events" / "day_2.parquet")
    views = t.column("views").to_numpy().astype(np.float64)
    views[5] = 1e39  # finite in the file, not in float32 after standardize
    pq.write_table(t.set_column(t.schema.get_field_index("views"), "views", pa.array(views)), tmp_path / "x.parquet")
    argv = ["predict", str(model / "model"), "--input", str(tmp_path / "x.parquet"), "--output", str(tmp_path / "p.csv"),
            "--no_progress", "--json"]  # fmt: skip
    line = one_line_error(capsys, *argv)
    assert "x.parquet:6: column views: " in line and "not a finite number" in line and "--on_bad_line skip" in line
    rc, out, err = cli(capsys, *argv, "--on_bad_line", "skip")
    assert rc == 0, err
    result = json.loads(out)
    assert result["rows"] == t.num_rows - 1 and result["skipped_rows"] == 1
    assert len((tmp_path / "p.csv").read_text().splitlines()) == t.num_rows  # a header and the rows scored


def test_predict_json_never_holds_nan(model, capsys, tmp_path):
    t = pq.read_table(model / "events" / "day_2.parquet").slice(0, 30)
    t = t.set_column(t.schema.get_field_index("clicked"), "clicked", pa.array(np.zeros(30, np.int64)))
    pq.write_table(t, tmp_path / "one_class.parquet")
    rc, out, err = cli(capsys, "predict", str(model / "model"), "--input", str(tmp_path / "one_class.parquet"),
                       "--output", str(tmp_path / "p.csv"), "--no_progress", "--json")  # fmt: skip
    assert rc == 0, err

    def refuse(constant: str):
        raise AssertionError(f"{constant} in the JSON: {out}")

    result = json.loads(out, parse_constant=refuse)
    assert result["auc"] is None and result["rows"] == 30


def test_predict_on_damaged_parquet_files_ends_in_one_line(model, capsys, tmp_path):
    for path in _damaged_parquets(tmp_path):
        line = one_line_error(capsys, "predict", str(model / "model"), "--input", str(path), "--output", str(tmp_path / "p.csv"),
                              "--no_progress")  # fmt: skip
        assert path.name in line, line


def test_predict_with_a_model_config_that_lost_a_dense_feature(model, capsys, tmp_path):
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(model / "model", folder)
    config = json.loads((folder / "model_config.json").read_text())
    config["schema"]["dense"] = config["schema"]["dense"][:1]
    (folder / "model_config.json").write_text(json.dumps(config))
    line = one_line_error(capsys, "predict", str(folder), "--input", str(model / "events" / "day_2.parquet"),
                          "--output", str(tmp_path / "p.csv"), "--no_progress")  # fmt: skip
    assert "model_config.json" in line and "dense" in line, line
