"""Generated event logs with a planted signal, as a user's own Parquet or CSV files would look:
string and integer ids, list features, missing values, a time column. For tests, the
benchmark and trying the own-data path without data of one's own::

    info = write_events("events/", days=4, rows_per_day=5000, seed=0)    # day_0.parquet ...
    info["bayes_auc"]["test"]     # the best AUC any model can reach on the last day

Columns: ``ts`` (seconds), ``user`` (string, power law over users), ``item`` (int),
``tags`` (0-4 strings), ``recent`` (0-5 recent item ids), ``price`` (float, 10% missing),
``views`` (int), ``clicked`` (0/1). The label is drawn from a logistic model of the user, the
item, the mean of the tags' weights, the recent items, log(price) and views, so the
Bayes-optimal AUC of each day is known exactly (:func:`bayes_auc`).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

# A schema for these events (what `data schema` proposes, with table sizes to spare).
SCHEMA = """
name: events
label: {column: clicked}
dense:
  - {name: price, transform: log1p}
  - {name: views, transform: standardize}
sparse:
  - {name: user, type: string, mapping: vocab, num_embeddings: 1000}
  - {name: item, type: int, mapping: hash, num_embeddings: 600}
  - {name: tags, type: string, list: true, mapping: vocab, num_embeddings: 100, pooling: mean}
  - {name: recent, type: int, list: true, mapping: modulo, num_embeddings: 300}
"""
DAY_S = 86_400
START = 1_700_000_000 // DAY_S * DAY_S  # 2023-11-14, a midnight
USERS, ITEMS, TAGS = 400, 300, 40


def _weights(seed: int) -> dict[str, np.ndarray]:
    g = np.random.default_rng([seed, 7])
    return {"user": g.normal(0, 0.9, USERS), "item": g.normal(0, 0.9, ITEMS), "tag": g.normal(0, 1.2, TAGS),
            "recent": g.normal(0, 0.6, ITEMS)}  # fmt: skip


def generate(rows: int, day: int, seed: int) -> dict[str, Any]:
    """One day of events as columns (numpy and lists), with each row's click probability."""
    w = _weights(seed)
    g = np.random.default_rng([seed, day])
    user = (g.random(rows) ** 2.5 * USERS).astype(np.int64)
    item = (g.random(rows) ** 2.0 * ITEMS).astype(np.int64)
    n_tags = g.integers(0, 5, rows)
    tags = [list(g.choice(TAGS, size=k, replace=False)) for k in n_tags]
    n_recent = g.integers(0, 6, rows)
    recent = [list((g.random(k) ** 2.0 * ITEMS).astype(np.int64)) for k in n_recent]
    price = np.exp(g.normal(3.0, 1.0, rows))
    views = g.poisson(3.0, rows)
    logit = (-0.8 + w["user"][user] + w["item"][item]
             + np.array([w["tag"][t].mean() if len(t) else 0.0 for t in tags])
             + np.array([w["recent"][r].sum() / 2 for r in recent])
             - 0.5 * (np.log1p(price) - 3.0) + 0.25 * (views - 3.0))  # fmt: skip
    p = 1 / (1 + np.exp(-logit))
    clicked = (g.random(rows) < p).astype(np.int64)
    missing = g.random(rows) < 0.1
    ts = START + day * DAY_S + np.sort(g.integers(0, DAY_S, rows))
    return {
        "ts": ts,
        "user": [f"u{u:04d}" for u in user],
        "item": item,
        "tags": [[f"t{t}" for t in ts_] for ts_ in tags],
        "recent": [[int(x) for x in r] for r in recent],
        "price": np.where(missing, np.nan, np.round(price, 2)),
        "views": views,
        "clicked": clicked,
        "p": p,
    }


def bayes_auc(p: np.ndarray, y: np.ndarray) -> float:
    """AUC of the true probabilities (ties counted half): the best a model can reach."""
    order = np.argsort(p, kind="stable")
    ranks = np.empty(len(p))
    sp = p[order]
    # average ranks of ties
    _, first, counts = np.unique(sp, return_index=True, return_counts=True)
    avg = first + (counts - 1) / 2.0 + 1
    ranks[order] = np.repeat(avg, counts)
    pos = y == 1
    n1, n0 = pos.sum(), (~pos).sum()
    return float((ranks[pos].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


def table_of(cols: dict[str, Any]) -> Any:
    import pyarrow as pa

    return pa.table({
        "ts": pa.array(cols["ts"], pa.int64()),
        "user": pa.array(cols["user"], pa.string()),
        "item": pa.array(cols["item"], pa.int64()),
        "tags": pa.array(cols["tags"], pa.list_(pa.string())),
        "recent": pa.array(cols["recent"], pa.list_(pa.int64())),
        "price": pa.array(cols["price"], pa.float64(), from_pandas=True),
        "views": pa.array(cols["views"], pa.int64()),
        "clicked": pa.array(cols["clicked"], pa.int64()),
    })  # fmt: skip


def write_csv(path: str, cols: dict[str, Any]) -> None:
    """The same rows as CSV: lists joined by ``|``, a missing price as an empty field."""
    with open(path, "w") as f:
        f.write("ts,user,item,tags,recent,price,views,clicked\n")
        for i in range(len(cols["ts"])):
            price = "" if np.isnan(cols["price"][i]) else repr(float(cols["price"][i]))
            f.write(f"{cols['ts'][i]},{cols['user'][i]},{cols['item'][i]},{'|'.join(cols['tags'][i])},"
                    f"{'|'.join(map(str, cols['recent'][i]))},{price},{cols['views'][i]},{cols['clicked'][i]}\n")  # fmt: skip


def write_events(folder: str, days: int = 4, rows_per_day: int = 5000, seed: int = 0, fmt: str = "parquet") -> dict[str, Any]:
    """``day_K.parquet`` (or ``.csv``) for K < ``days``; returns the files, the day
    boundaries as timestamps and the Bayes-optimal AUC of each day."""
    import pyarrow.parquet as pq

    os.makedirs(folder, exist_ok=True)
    files, aucs = [], []
    for day in range(days):
        cols = generate(rows_per_day, day, seed)
        path = os.path.join(folder, f"day_{day}.{fmt}")
        if fmt == "parquet":
            pq.write_table(table_of(cols), path, row_group_size=max(1, rows_per_day // 3))
        else:
            write_csv(path, cols)
        files.append(path)
        aucs.append(bayes_auc(cols["p"], cols["clicked"]))
    return {"files": files, "day_starts": [START + d * DAY_S for d in range(days)], "bayes_auc_by_day": aucs}
