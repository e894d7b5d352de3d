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

A world that drifts from day to day (``drift=Drift(...)``; the default draws the same rows as
without it), for the daily loop (bench/daily_bench.py, docs/daily.md)::

    write_events("events/", days=7, drift=Drift(new_items=40, popularity_shift=0.1, user_churn=0.1))

- ``new_items``: each day that many items appear (ids after the last one) and take the top
  of the popularity ranking, pushing older items down;
- ``popularity_shift``: each day the older items' ranking rotates by this fraction of them;
- ``user_churn``: each day about this fraction of the user slots gets a new user (a new id,
  ``u0042-3``, with a weight of its own), the one before never seen again.
Each new item and user has its own weight, so the model must learn them as they come; the
click probability of every row is still known, and so the Bayes AUC of each day.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

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


@dataclass(frozen=True)
class Drift:
    """How the world changes from one day to the next (module docstring); zeros: it does not."""

    new_items: int = 0
    popularity_shift: float = 0.0
    user_churn: float = 0.0

    def __bool__(self) -> bool:
        return bool(self.new_items or self.popularity_shift or self.user_churn)


def _drifted(seed: int, day: int, drift: Drift, w: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Day ``day``'s items by popularity rank (newest first), every item's weight and recent
    weight so far (the first ``ITEMS`` are the still world's)."""
    total = ITEMS + drift.new_items * day
    g = np.random.default_rng([seed, 8])
    extra = g.normal(0, 0.9, (2, drift.new_items * day))
    item_w = np.concatenate((w["item"], extra[0]))
    recent_w = np.concatenate((w["recent"], extra[1] * 0.6 / 0.9))
    newest = np.arange(total - 1, ITEMS - 1, -1)  # today's new items, then yesterday's, ...
    shift = int(round(drift.popularity_shift * ITEMS * day)) % ITEMS
    older = np.roll(np.arange(ITEMS), -shift)
    return np.concatenate((newest, older)), item_w, recent_w


def _users(seed: int, day: int, drift: Drift, slot: np.ndarray, w: dict[str, np.ndarray]) -> tuple[list[str], np.ndarray]:
    """The user of each slot on day ``day`` (a slot's occupant changes about ``user_churn`` of
    the days, at a phase of its own) and their weights."""
    phase = np.random.default_rng([seed, 9]).random(USERS)
    gen = np.floor(day * drift.user_churn + phase).astype(np.int64) - np.floor(phase).astype(np.int64)
    weights = w["user"][slot].copy()
    for k in np.unique(gen[slot]):
        if k:
            mine = gen[slot] == k
            weights[mine] = np.random.default_rng([seed, 10, int(k)]).normal(0, 0.9, USERS)[slot[mine]]
    names = [f"u{u:04d}" if not k else f"u{u:04d}-{k}" for u, k in zip(slot, gen[slot])]
    return names, weights


def generate(rows: int, day: int, seed: int, drift: Optional[Drift] = None) -> dict[str, Any]:
    """One day of events as columns (numpy and lists), with each row's click probability."""
    w = _weights(seed)
    g = np.random.default_rng([seed, day])
    user = (g.random(rows) ** 2.5 * USERS).astype(np.int64)
    item_u = g.random(rows) ** 2.0
    n_tags = g.integers(0, 5, rows)
    tags = [list(g.choice(TAGS, size=k, replace=False)) for k in n_tags]
    n_recent = g.integers(0, 6, rows)
    recent_u = [g.random(k) ** 2.0 for k in n_recent]
    price = np.exp(g.normal(3.0, 1.0, rows))
    views = g.poisson(3.0, rows)
    if drift:
        ranked, item_w, recent_w = _drifted(seed, day, drift, w)
        item = ranked[(item_u * len(ranked)).astype(np.int64)]
        recent = [ranked[(u * len(ranked)).astype(np.int64)] for u in recent_u]
        names, user_w = _users(seed, day, drift, user, w)
    else:
        item_w, recent_w = w["item"], w["recent"]
        item = (item_u * ITEMS).astype(np.int64)
        recent = [(u * ITEMS).astype(np.int64) for u in recent_u]
        names, user_w = [f"u{u:04d}" for u in user], w["user"][user]
    logit = (-0.8 + user_w + item_w[item]
             + np.array([w["tag"][t].mean() if len(t) else 0.0 for t in tags])
             + np.array([recent_w[r].sum() / 2 for r in recent])
             - 0.5 * (np.log1p(price) - 3.0) + 0.25 * (views - 3.0))  # fmt: skip
    p = 1 / (1 + np.exp(-logit))
    clicked = (g.random(rows) < p).astype(np.int64)
    missing = g.random(rows) < 0.1
    ts = START + day * DAY_S + np.sort(g.integers(0, DAY_S, rows))
    return {
        "ts": ts,
        "user": names,
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


def write_events(folder: str, days: int = 4, rows_per_day: int = 5000, seed: int = 0, fmt: str = "parquet",
                 drift: Optional[Drift] = None) -> dict[str, Any]:  # fmt: skip
    """``day_K.parquet`` (or ``.csv``) for K < ``days``; returns the files, the day
    boundaries as timestamps and the Bayes-optimal AUC of each day."""
    import pyarrow.parquet as pq

    os.makedirs(folder, exist_ok=True)
    files, aucs = [], []
    for day in range(days):
        cols = generate(rows_per_day, day, seed, drift)
        path = os.path.join(folder, f"day_{day}.{fmt}")
        if fmt == "parquet":
            pq.write_table(table_of(cols), path, row_group_size=max(1, rows_per_day // 3))
        else:
            write_csv(path, cols)
        files.append(path)
        aucs.append(bayes_auc(cols["p"], cols["clicked"]))
    return {"files": files, "day_starts": [START + d * DAY_S for d in range(days)], "bayes_auc_by_day": aucs}
