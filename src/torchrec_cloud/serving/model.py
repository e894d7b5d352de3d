"""A served model: an exported model folder loaded once, raw rows in, click probabilities out,
and nothing of HTTP (``server.py`` owns the protocols)::

    model = ServedModel("models/ev")
    model.load()                                  # scorer, transforms; scores the canary rows
    model.columns                                 # what a request must carry: name and kind
    [p] = model.predict([table])                  # pyarrow rows of those columns -> float64 [N]

It has the shape of KServe's Python model (``load()``, ``ready``, ``predict``). Rows are
converted by the code ``predict --input`` runs on a file: for a model of a schema's dataset,
:class:`~torchrec_cloud.data.transforms.Transforms` with the vocabularies, hash rule and dense
statistics ``export`` put in the folder, then the batches training read
(:func:`~torchrec_cloud.data.reader.batch_of`); for a Criteo model, preprocessing's TSV
parser (``criteo_parse.parse_block``) on the request's fields and the shards' own record-to-batch
code. So a row scores here as it does in ``predict --input`` (tests/test_serve.py checks both).

Criteo's ``torchrec`` dense transform is ``log(x - (m - 2))`` with ``m`` the smallest value of
the file scored; here the file is the request, so ``m`` is the request's smallest dense value
(a model trained with ``--dense_transform log1p`` scores each row on its own).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from torchrec_cloud import storage
from torchrec_cloud.serving import CONFIG_FILE, SCORER_FILE, ServingError, read_model_config, saved_job_config
from torchrec_cloud.untrusted import UntrustedInputError

# Kinds of request column: a number (a dense feature), one id, a list of ids (BYTES joined by
# the schema's separator, or a JSON list), and Criteo's integer and hexadecimal fields.
NUMBER, ID, IDS, CRITEO_INT, CRITEO_HEX = "number", "id", "ids", "int", "hex"


@dataclass(frozen=True)
class Column:
    """One column a request carries: its name, kind, and a list's separator."""

    name: str
    kind: str
    separator: str = "|"


class RequestError(ValueError):
    """Rows the model cannot score (a value that does not convert): the request's fault, one line."""


class ServedModel:
    """One exported model folder (local or a bucket URL), ready to score raw rows."""

    def __init__(self, model_dir: str, version: Optional[str] = None, runtime: str = "auto") -> None:
        self.model_dir, self.runtime = model_dir, runtime  # serving.runtime.RUNTIMES
        self.version = version or model_dir.rstrip("/").rsplit("/", 1)[-1] or "1"
        self.ready = False
        self.config = read_model_config(model_dir)  # cheap: a bad folder is refused before load()
        self.cfg = saved_job_config(self.config, storage.join(model_dir, CONFIG_FILE))
        if "transforms" in self.config:
            self.converter: Union[_SchemaRows, _CriteoRows] = _SchemaRows(self.config, model_dir, self.cfg)
        elif self.cfg.model.num_dense_features == 13 and self.cfg.model.num_sparse_features == 26:
            self.converter = _CriteoRows(self.cfg)
        else:
            raise ServingError(f"{model_dir} scores neither a schema's rows nor Criteo's (a synthetic-data model?): "
                               "serve needs a model trained on a schema's dataset or on Criteo data")  # fmt: skip
        self.columns: list[Column] = self.converter.columns
        self.scorer: Any = None

    def load(self) -> None:
        """Read the scorer and score the canary rows once (the first call also warms it up):
        ``ready`` after that; a ServingError naming the folder otherwise."""
        from torchrec_cloud.serving.runtime import load_scorer

        # The AOTInductor package when the folder has one built by this torch (runtime
        # "auto"), else TorchScript: serving.runtime.
        self.scorer = load_scorer(self.model_dir, self.runtime, config=self.config)
        self.canary()
        self.ready = True

    def canary(self) -> None:
        """Score a few rows built from the columns (one all missing): each must come out a
        probability, or the model is refused."""
        texts = {NUMBER: ["", "0", "1.5", "3"], ID: ["", "1", "7", "42"], IDS: ["", "1", "1{sep}7", "42"],
                 CRITEO_INT: ["", "0", "1", "5"], CRITEO_HEX: ["", "0", "a1", "ff"]}  # fmt: skip
        table = pa.table({c.name: pa.array([t.replace("{sep}", c.separator) or None for t in texts[c.kind]], pa.string())
                          for c in self.columns})  # fmt: skip
        try:
            [out] = self.predict([table])
        except Exception as e:  # noqa: BLE001 - any failure refuses the model, named
            raise ServingError(f"{self.model_dir}: the canary rows do not score ({type(e).__name__}: {e})") from None
        if isinstance(out, Exception):
            raise ServingError(f"{self.model_dir}: the canary rows do not convert ({out})")
        if out.shape != (4,) or not np.all(np.isfinite(out)) or not np.all((out >= 0) & (out <= 1)):
            raise ServingError(f"{self.model_dir}: the canary rows score {out.tolist()}, not 4 probabilities")

    def predict(self, tables: Sequence[pa.Table]) -> list[Union[np.ndarray, RequestError]]:
        """Click probabilities (float64) of each table's rows, scored together as one batch:
        for each table its probabilities, or the RequestError that its rows raised (the other
        tables are scored all the same)."""
        import torch

        results: list[Union[np.ndarray, RequestError]] = []
        parts, sizes = [], []
        for table in tables:
            try:
                part = self.converter.convert(table)
            except RequestError as e:
                results.append(e)
                continue
            results.append(np.empty(0))
            parts.append(part)
            sizes.append(table.num_rows)
        if parts:
            batch = self.converter.batch(parts)
            kjt = batch.sparse_features
            with torch.no_grad():
                logits = self.scorer.logits_of_bags(batch.dense_features, kjt.values(), kjt.lengths())
            probabilities = torch.sigmoid(logits.double()).numpy()
            offsets = np.cumsum([0, *sizes])
            k = 0
            for i, r in enumerate(results):
                if not isinstance(r, RequestError):
                    results[i] = probabilities[offsets[k] : offsets[k + 1]]
                    k += 1
        return results


class _SchemaRows:
    """Rows of a schema's columns through the model folder's transforms (as ``predict --input``)."""

    def __init__(self, config: dict[str, Any], model_dir: str, cfg: Any) -> None:
        from torchrec_cloud.data.dataset import check_transforms, read_vocabularies
        from torchrec_cloud.data.schema import parse_schema
        from torchrec_cloud.data.transforms import Transforms

        where = storage.join(model_dir, CONFIG_FILE)
        try:
            schema = parse_schema(config.get("schema"), f"{where} (schema)")
            spec = check_transforms(config.get("transforms"), schema, where, "transforms")
            if spec["table_sizes"] != cfg.model.table_sizes:
                raise UntrustedInputError(where, "transforms.table_sizes",
                                          f"{spec['table_sizes']} differ from the model's tables {cfg.model.table_sizes}")  # fmt: skip
            vocab = read_vocabularies(model_dir, spec["vocab"], where)
        except UntrustedInputError as e:
            raise ServingError(str(e)) from None
        self.schema = schema
        self.transforms = Transforms(schema, vocab, spec["dense_stats"])
        self.keys = [f.name for f in schema.sparse]
        self.singles = [k for k, f in enumerate(schema.sparse) if not f.list]
        self.lists = [k for k, f in enumerate(schema.sparse) if f.list]
        self.table_sizes = np.asarray(spec["table_sizes"], np.int64)
        cols = {f.column: Column(f.column, NUMBER) for f in schema.dense}
        for f in schema.sparse:
            cols.setdefault(f.column, Column(f.column, IDS if f.list else ID, f.separator))
        self.columns = list(cols.values())

    def convert(self, table: pa.Table) -> Any:
        from torchrec_cloud.data.dataset import Rows

        try:
            enc = self.transforms.encode(table, None, labelled=False)
        except (TypeError, pa.ArrowException) as e:
            raise RequestError(" ".join(str(e).split())) from None
        if enc.bad_count:
            row, reason = min(enc.bad.items())
            raise RequestError(f"row {row}: {reason}")
        return Rows(enc.records, enc.lists)

    def batch(self, parts: Sequence[Any]) -> Any:
        from torchrec_cloud.data.dataset import Rows
        from torchrec_cloud.data.reader import batch_of

        rows = Rows.concat(list(parts), self.transforms.dtype, len(self.lists), self.transforms.list_dtype)
        return batch_of(rows, self.keys, self.singles, self.lists, self.table_sizes, "the request")


_DECIMAL = r"^-?[0-9]{1,10}$"
_HEX = r"^[0-9a-fA-F]{1,15}$"


class _CriteoRows:
    """Raw Criteo fields (``int_0`` .. ``int_12``, ``cat_0`` .. ``cat_25``; empty or null:
    missing) through preprocessing's TSV parser with the model's table sizes, then the shards'
    conversion to a batch, as ``predict --input FILE.tsv`` reads a file of the same rows."""

    def __init__(self, cfg: Any) -> None:
        from torchrec_cloud.data.criteo_format import DENSE_NAMES, SPARSE_NAMES
        from torchrec_cloud.data.criteo_reader import CriteoTSV

        self.tsv = CriteoTSV("the request", batch_size=1, table_sizes=cfg.model.table_sizes,
                             dense_transform=cfg.data.dense_transform, multi_hot_sizes=cfg.data.multi_hot_sizes,
                             multi_hot_pooling=cfg.data.multi_hot_pooling, seed=cfg.data.seed)  # fmt: skip
        self.columns = [Column(n, CRITEO_INT) for n in DENSE_NAMES] + [Column(n, CRITEO_HEX) for n in SPARSE_NAMES]

    def convert(self, table: pa.Table) -> tuple[np.ndarray, np.ndarray]:
        from torchrec_cloud.data.criteo_parse import parse_block

        n = table.num_rows
        fields = [np.full(n, "0", object)]  # the label field the parser expects; not used
        for c in self.columns:
            values = table.column(c.name)
            text = pc.fill_null(pc.cast(values, pa.string()), "")
            ok = pc.or_(pc.equal(text, ""), pc.match_substring_regex(text, _DECIMAL if c.kind == CRITEO_INT else _HEX))
            bad = np.flatnonzero(~ok.to_numpy(zero_copy_only=False))
            if len(bad):
                what = "an integer" if c.kind == CRITEO_INT else "a hexadecimal id of at most 15 digits"
                raise RequestError(f"row {int(bad[0])}: column {c.name}: not {what}: {text[int(bad[0])].as_py()[:40]!r}")
            fields.append(text.to_numpy(zero_copy_only=False))
        lines = "".join("\t".join(row) + "\n" for row in zip(*fields)).encode()
        parsed = parse_block(lines, self.tsv.table_sizes, self.tsv.dtype)
        if len(parsed.bad_lines):
            first = int(parsed.bad_lines[0])
            raise RequestError(f"row {first}: {parsed.reasons.get(first, 'malformed row')}")
        records = parsed.records
        shift = 0
        if self.tsv.dense_transform != "log1p" and len(records):
            shift = int(records["dense"].min()) - 2
        return records, np.full(len(records), shift, np.int64)

    def batch(self, parts: Sequence[tuple[np.ndarray, np.ndarray]]) -> Any:
        records = np.concatenate([p[0] for p in parts])
        shift = np.concatenate([p[1] for p in parts])
        return self.tsv.batcher(records, shift, None)
