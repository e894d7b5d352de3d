"""Numeric buckets and string labels, as a user brings them: a tabular Parquet file with a
mostly-zero amount, an age, a small count and a string outcome (``purchase``, ``subscribe``,
``7``, ... of which some count as 1), from a schema to scores.

One module-scoped run does the expensive part once: preprocess (split by input file),
train one process a few steps, export. The tests read it: predict on the raw test file gives
exactly the run's test AUC, the mostly-zero and few-valued columns get useful quantile
boundaries, the label's boundaries sit at the age band's steps, the labels are the outcomes
the schema names. A second, smaller preprocessing run (CSV, a planted step, no training)
shows label boundaries landing at the step where quantiles do not, counted on training rows
only, and the counts files' positives checked when read back. Beside them: bad bucketize and
label specs, each one line."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers import PYTHON, cli, evals, explain, read_metrics, run
from torchrec_cloud.cli import main

ROWS = {"train": 3000, "val": 600, "test": 600}
POSITIVE = ["purchase", "subscribe", 7]  # a number in the list matches the text "7" too
SCHEMA = """
name: shop
label: {column: outcome, positive: [purchase, subscribe, 7]}
dense:
  - {name: amount, transform: bucketize, keep_dense: log1p, boundaries: quantiles}
  - {name: age, transform: bucketize, buckets: 16}
  - {name: visits, transform: bucketize, keep_dense: true, boundaries: quantiles}
sparse:
  - {name: country, type: string, mapping: vocab, num_embeddings: 10}
"""
MODEL = ["--embedding_dim", "8", "--dense_arch_layer_sizes", "16,8", "--over_arch_layer_sizes", "16,1",
         "--learning_rate", "0.05", "--batch_size", "200", "--no-progress", "--no-tensorboard", "--eval_every", "0"]  # fmt: skip


def rows(n: int, seed: int) -> pa.Table:
    """Rows whose outcome depends on steps of the numbers: an amount over 40, an age in
    30..39, 3 or more visits. 90% of amounts are 0, 5% missing."""
    rng = np.random.default_rng(seed)
    amount = np.where(rng.random(n) < 0.9, 0.0, np.round(rng.lognormal(3.5, 1.0, n), 2))
    age = rng.integers(18, 80, n)
    visits = rng.integers(0, 5, n)
    logit = -1.5 + 2.0 * (amount > 40) + 1.5 * ((age >= 30) & (age < 40)) + 1.0 * (visits >= 3)
    positive = rng.random(n) < 1 / (1 + np.exp(-logit))
    outcome = np.where(positive, rng.choice(["purchase", "subscribe", "7"], n), rng.choice(["view", "bounce", "3"], n))
    amount_col = pa.array(amount, mask=rng.random(n) < 0.05)
    return pa.table({"outcome": outcome, "amount": amount_col, "age": age, "visits": visits,
                     "country": rng.choice(["fr", "de", "us", "jp"], n)})  # fmt: skip


@pytest.fixture(scope="module")
def shop(tmp_path_factory):
    """Preprocessed (train, val, test: one Parquet file each), trained a few steps, exported."""
    root = tmp_path_factory.mktemp("shop")
    (root / "raw").mkdir()
    for k, (split, n) in enumerate(ROWS.items()):
        pq.write_table(rows(n, k), root / "raw" / f"{split}.parquet")
    (root / "schema.yaml").write_text(SCHEMA)
    inputs = [str(root / "raw" / f"{s}.parquet") for s in ROWS]
    assert main(["data", "preprocess", "--no_progress", "--schema", str(root / "schema.yaml"), "--input", *inputs,
                 "--output", str(root / "data"), "--split_by", "input", "--val_from", "val.parquet",
                 "--test_from", "test.parquet"]) == 0  # fmt: skip
    proc = run([PYTHON, "-m", "torchrec_cloud", "train", "--dataset_path", str(root / "data"), *MODEL, "--num_epochs", "1",
                "--checkpoint_path", str(root / "ck"), "--output_dir", str(root / "run")])  # fmt: skip
    assert proc.returncode == 0, explain(proc)
    assert main(["export", str(root / "ck"), "--output", str(root / "model")]) == 0
    return root


def test_predict_on_raw_rows_with_buckets_and_string_labels_equals_the_run(shop, capsys, tmp_path):
    records = read_metrics(shop / "run")
    assert records[0]["config"]["model"]["feature_names"] == ["country", "amount", "age", "visits"]
    test = evals(records, "test")[-1]
    assert test["rows"] == ROWS["test"] and 0 < test["auc"] < 1
    config = json.loads((shop / "model" / "model_config.json").read_text())
    assert set(config["transforms"]["boundaries"]) == {"amount", "age", "visits"}  # carried by export
    rc, out, err = cli(capsys, "predict", str(shop / "model"), "--input", str(shop / "raw" / "test.parquet"),
                       "--output", str(tmp_path / "scores.csv"), "--json", "--no_progress")  # fmt: skip
    assert rc == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    assert result["rows"] == ROWS["test"]
    assert result["auc"] == pytest.approx(test["auc"], abs=1e-6)
    assert result["logloss"] == pytest.approx(test["logloss"], rel=1e-5)


def test_mostly_zero_and_few_valued_columns_get_useful_quantile_boundaries(shop):
    from torchrec_cloud.data.buckets import bucket_rows
    from torchrec_cloud.data.dataset import load_dataset

    ds = load_dataset(str(shop / "data"))
    bounds = ds.boundaries
    train = pq.read_table(shop / "raw" / "train.parquet")
    amount = train.column("amount").to_numpy(zero_copy_only=False).astype(np.float64)
    nonzero = amount[amount > 0]
    # Plain quantiles of a column that is 90% zeros give one boundary or two; here the zeros
    # have a bucket of their own and the rest spread over the others.
    assert len(np.unique(np.quantile(amount[~np.isnan(amount)], np.linspace(0, 1, 33)[1:-1]))) <= 4
    assert len(bounds["amount"]) >= 20 and bounds["amount"][0] < nonzero.min()
    share = np.bincount(bucket_rows(nonzero, np.asarray(bounds["amount"]))) / len(nonzero)
    assert share.max() < 0.1, share
    assert bounds["visits"] == [0.5, 1.5, 2.5, 3.5]  # 5 distinct values: one bucket each
    # Age (boundaries: label, the default): the band 30..39 that moves the label, nothing else.
    assert bounds["age"] == [29.5, 39.5]
    # The manifest's schema keeps which way each column's boundaries were chosen (None: quantiles).
    assert {f.name: f.boundaries for f in ds.schema.sparse if f.mapping == "bucketize"} == {
        "amount": None, "age": "label", "visits": None}
    # The table rows as stored: row 0 for a missing amount, row 1 for a zero.
    transforms = ds.transforms()
    enc = transforms.encode(train.slice(0, 200), None)
    column = [f.name for f in ds.schema.singles].index("amount")
    stored = enc.records["sparse"][:, column]
    raw = amount[:200]
    assert (stored[np.isnan(raw)] == 0).all() and (stored[raw == 0] == 1).all() and (stored[raw > 0] > 1).all()


def test_string_labels_are_the_outcomes_the_schema_names(shop):
    from torchrec_cloud.data.dataset import load_dataset
    from torchrec_cloud.data.reader import SchemaSource

    ds = load_dataset(str(shop / "data"))
    source = SchemaSource(ds, batch_size=ROWS["test"], rank=0, world_size=1)
    batch, _ = next(source.eval_batches("test"))
    outcome = pq.read_table(shop / "raw" / "test.parquet").column("outcome").to_pylist()
    expected = [1.0 if v in ("purchase", "subscribe", "7") else 0.0 for v in outcome]
    assert batch.labels.tolist() == expected and 0 < sum(expected) < len(expected)


def test_numbers_in_positive_match_numeric_and_text_labels():
    from torchrec_cloud.data.schema import parse_schema
    from torchrec_cloud.data.transforms import Transforms

    schema = parse_schema({"label": {"column": "code", "positive": [2, 3.5, "4"]}, "dense": [{"name": "x"}],
                           "sparse": [{"name": "u", "num_embeddings": 5}]}, "schema.yaml")  # fmt: skip
    t = Transforms(schema, {}, {})
    for code in (pa.array([1, 2, 3.5, 4, 2.0]), pa.array(["1", "2", "3.5", "4", "2.0"])):
        table = pa.table({"code": code, "x": [0.0] * 5, "u": ["a"] * 5})
        assert t.encode(table, None).records["label"].tolist() == [0, 1, 1, 1, 1], code.type
    table = pa.table({"code": pa.array([None, 2], pa.int64()), "x": [0.0] * 2, "u": ["a"] * 2})
    assert list(t.encode(table, None).bad.values()) == ["column code: the label is missing"]


BAD = {
    "buckets: 1": ("dense: [{name: a, transform: bucketize, buckets: 1, keep_dense: true}]",
                   "dense[0].buckets: must be an integer in 2..1024, got 1"),
    "buckets on log1p": ("dense: [{name: a, transform: log1p, buckets: 8}]",
                         "dense[0].buckets: applies to transform: bucketize only"),
    "keep_dense: maybe": ("dense: [{name: a, transform: bucketize, keep_dense: maybe}]",
                          "dense[0].keep_dense: must be true, false or a transform"),
    "fill without keep_dense": ("dense: [{name: b}, {name: a, transform: bucketize, fill: 0}]",
                                "dense[1].fill: a missing value has a bucket of its own"),
    "no dense input left": ("dense: [{name: a, transform: bucketize}]",
                            "dense: needs at least one dense feature"),
    "bucket name taken": ("dense: [{name: u, transform: bucketize, keep_dense: true}]",
                          "sparse: the name u is used twice (a bucketized dense feature is also a sparse feature"),
    "boundaries: median": ("dense: [{name: a, transform: bucketize, keep_dense: true, boundaries: median}]",
                           "dense[0].boundaries: must be one of 'label', 'quantiles', got median"),
    "boundaries on log1p": ("dense: [{name: a, transform: log1p, boundaries: label}]",
                            "dense[0].boundaries: applies to transform: bucketize only"),
    "boundaries on a hashed id": ("dense: [{name: b}]\nsparse: [{name: u, num_embeddings: 9, boundaries: label}]",
                                  "sparse[0].boundaries: applies to mapping: bucketize only"),
    "bucketize a list": ("dense: [{name: b}]\nsparse: [{name: u, num_embeddings: 9}, {name: t, mapping: bucketize, "
                         "list: true, num_embeddings: 9}]", "sparse[1].list: bucketize reads one number per row"),
    "number ids hashed": ("dense: [{name: b}]\nsparse: [{name: u, type: number, num_embeddings: 9}]",
                          "sparse[0].type: must be one of 'string', 'int', got number"),
    "empty positive": ("label: {column: y, positive: []}", "label.positive: needs at least one value that counts as 1"),
    "positive and threshold": ("label: {column: y, threshold: 3, positive: [a]}",
                               "label.positive: give threshold or positive, not both"),
    "a boolean positive": ("label: {column: y, positive: [yes]}",
                           "label.positive[0]: must be text or a number (quote it in the YAML), got True"),
    "positive not a list": ("label: {column: y, positive: purchase}", "label.positive: must be a list"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD))
def test_bad_bucketize_and_label_specs_are_one_line(case, capsys, tmp_path):
    text, expected = BAD[case]
    doc = {"label": "label: {column: y}", "dense": "dense: [{name: b}]", "sparse": "sparse: [{name: u, num_embeddings: 9}]"}
    for line in text.split("\n"):
        doc[line.split(":")[0]] = line
    (tmp_path / "schema.yaml").write_text("\n".join(doc.values()) + "\n")
    pq.write_table(pa.table({"y": [0, 1], "a": [1.0, 2.0], "b": [1.0, 2.0], "u": ["x", "y"], "t": ["1", "2"]}),
                   tmp_path / "in.parquet")  # fmt: skip
    rc, out, err = cli(capsys, "data", "preprocess", "--no_progress", "--schema", str(tmp_path / "schema.yaml"),
                       "--input", str(tmp_path / "in.parquet"), "--output", str(tmp_path / "out"))  # fmt: skip
    assert rc != 0 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], (case, err)


def test_crafted_boundaries_are_refused_with_one_line(shop, capsys, tmp_path):
    copy = tmp_path / "data"
    shutil.copytree(shop / "data", copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["transforms"]["boundaries"]["age"].reverse()
    (copy / "manifest.json").write_text(json.dumps(manifest))
    rc, out, err = cli(capsys, "data", "verify", str(copy))
    assert rc != 0 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "transforms.boundaries.age: must increase" in err


def test_data_schema_proposes_buckets_for_numbers(shop, capsys, tmp_path):
    from torchrec_cloud.data.schema import load_schema

    out = tmp_path / "proposed.yaml"
    rc, _, err = cli(capsys, "data", "schema", "--input", str(shop / "raw" / "train.parquet"), "--output", str(out))
    assert rc == 0, err
    schema = load_schema(str(out))
    assert [f.name for f in schema.sparse if f.mapping == "bucketize"] == ["amount", "age", "visits"], out.read_text()
    assert {f.name: f.transform for f in schema.dense} == {"amount": "log1p", "age": "standardize",
                                                           "visits": "standardize"}, out.read_text()  # fmt: skip


# ---------------------------------------------------------------------------------------
# Boundaries chosen with the label, on a planted step.

STEP = 30.0
STEP_SCHEMA = """
name: step
label: {column: y}
dense:
  - {name: x, transform: bucketize, buckets: 4, keep_dense: true}
  - {name: xq, column: x, transform: bucketize, buckets: 4, boundaries: quantiles}
sparse:
  - {name: u, type: string, mapping: hash, num_embeddings: 8}
"""


def step_rows(n: int, day: int, step: float, seed: int) -> list[str]:
    """CSV lines: ``x`` uniform in [0, 100) (5% missing), ``y`` drawn with probability 0.25
    at or below ``step`` and 0.6 above it."""
    rng = np.random.default_rng(seed)
    x = np.round(rng.random(n) * 100, 2)
    y = (rng.random(n) < np.where(x > step, 0.6, 0.25)).astype(int)
    missing = rng.random(n) < 0.05
    return [f"{day},{'' if m else v},{k},u{i % 3}" for i, (v, k, m) in enumerate(zip(x, y, missing))]


@pytest.fixture(scope="module")
def step(tmp_path_factory):
    """4,000 training rows (day 0) whose label steps at x = 30; the validation and test days
    step at 70 instead, so boundaries counted on them would show it. Preprocessed only."""
    root = tmp_path_factory.mktemp("step")
    lines = step_rows(4000, 0, STEP, 0) + step_rows(500, 1, 70.0, 1) + step_rows(500, 2, 70.0, 2)
    (root / "rows.csv").write_text("day,x,y,u\n" + "\n".join(lines) + "\n")
    (root / "schema.yaml").write_text(STEP_SCHEMA)
    assert main(["data", "preprocess", "--no_progress", "--schema", str(root / "schema.yaml"), "--input",
                 str(root / "rows.csv"), "--output", str(root / "data"), "--split_by", "day", "--val_from", "1",
                 "--test_from", "2"]) == 0  # fmt: skip
    return root


def training_x(root) -> tuple[np.ndarray, np.ndarray]:
    import pyarrow.csv as pcsv

    t = pcsv.read_csv(root / "rows.csv")
    train = t.filter(pa.compute.equal(t.column("day"), 0))
    x = train.column("x").to_numpy(zero_copy_only=False).astype(np.float64)
    return x, train.column("y").to_numpy().astype(np.int64)


def test_label_boundaries_land_at_a_planted_step_where_quantiles_do_not(step):
    from torchrec_cloud.data.buckets import FINE_BINS, boundaries
    from torchrec_cloud.data.dataset import load_dataset

    bounds = load_dataset(str(step / "data")).boundaries
    x, _ = training_x(step)
    values, counts = np.unique(x[~np.isnan(x)], return_counts=True)
    fine = np.asarray(boundaries(values, counts, FINE_BINS))  # the thresholds a label split may take
    at = np.searchsorted(fine, STEP)
    near = (fine[max(at - 2, 0)], fine[min(at + 1, len(fine) - 1)])  # within one fine bin of the step
    assert any(near[0] <= b <= near[1] for b in bounds["x"]), (bounds["x"], near)
    # Nothing where only the validation and test days step: boundaries come from training rows.
    assert not any(60 <= b <= 80 for b in bounds["x"]), bounds["x"]
    # The same column's quantile boundaries split it in four equal parts, far from the step.
    assert len(bounds["xq"]) == 3 and not any(near[0] - 1 <= b <= near[1] + 1 for b in bounds["xq"]), bounds["xq"]


def test_counts_files_keep_each_values_positives_from_training_rows(step):
    from torchrec_cloud.data.buckets import Summary, label_boundaries
    from torchrec_cloud.data.dataset import load_dataset

    doc = json.loads((step / "data" / "_counts" / "00000-rows.json").read_text())
    x, y = training_x(step)
    known = ~np.isnan(x)
    summary = doc["summaries"]["x"]
    values, inverse = np.unique(x[known], return_inverse=True)
    assert summary["values"] == values.tolist()
    assert summary["weights"] == np.bincount(inverse).tolist()
    assert summary["positives"] == np.bincount(inverse, weights=y[known]).astype(int).tolist()
    # Read back, they give the boundaries the manifest holds.
    s = Summary()
    s.merge(summary["values"], summary["weights"], summary["positives"])
    assert label_boundaries(s.values, s.weights, s.positives, 4) == load_dataset(str(step / "data")).boundaries["x"]


DAMAGED = {
    "more positives than rows": (lambda s: s["positives"].__setitem__(3, s["weights"][3] + 1),
                                 "summaries.x.positives[3]: more positive labels"),
    "negative": (lambda s: s["positives"].__setitem__(0, -1), "summaries.x.positives[0]: must be an integer"),
    "not an integer": (lambda s: s["positives"].__setitem__(1, 0.5), "summaries.x.positives[1]: must be an integer"),
    "one short": (lambda s: s["positives"].pop(), "summaries.x: values, weights and positives differ in length"),
    "missing": (lambda s: s.pop("positives"), "summaries.x.positives"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(DAMAGED))
def test_a_damaged_positives_entry_in_a_counts_file_is_refused_in_one_line(step, case, capsys, tmp_path):
    damage, expected = DAMAGED[case]
    doc = json.loads((step / "data" / "_counts" / "00000-rows.json").read_text())
    damage(doc["summaries"]["x"])
    (tmp_path / "out" / "_counts").mkdir(parents=True)
    (tmp_path / "out" / "_counts" / "00000-rows.json").write_text(json.dumps(doc))  # as another share wrote it
    rc, out, err = cli(capsys, "data", "preprocess", "--no_progress", "--schema", str(step / "schema.yaml"), "--input",
                       str(step / "rows.csv"), "--output", str(tmp_path / "out"), "--split_by", "day", "--val_from", "1",
                       "--test_from", "2")  # fmt: skip
    assert rc != 0 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "00000-rows.json" in lines[0] and expected in lines[0], (case, err)
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_a_compressed_summary_keeps_its_rows_and_positives():
    from torchrec_cloud.data.buckets import Summary

    rng = np.random.default_rng(0)
    x = rng.normal(size=5000)
    y = (rng.random(5000) < 0.3).astype(np.int64)
    s = Summary(points=64)
    for k in range(0, 5000, 500):
        s.add(x[k:k + 500], y[k:k + 500])
    assert len(s.values) <= 128  # compressed: memory bounded whatever the rows
    assert s.weights.sum() == 5000 and s.positives.sum() == y.sum()
    assert (0 <= s.positives).all() and (s.positives <= s.weights).all()
