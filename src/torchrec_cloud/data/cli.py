"""``torchrec-cloud data``: your events (Parquet, CSV/TSV) or Criteo's TSV to the shards that
``train --dataset_path`` reads::

    torchrec-cloud data schema --input events.parquet --output schema.yaml      # propose, then edit
    torchrec-cloud data preprocess --schema schema.yaml --input s3://bucket/events/ \
        --output s3://bucket/events-shards --split_by ts --val_from 2024-03-01 --test_from 2024-03-15
    torchrec-cloud data preprocess --format kaggle --input train.txt --output /data/kaggle \
        --num_embeddings 10000000                                                # Criteo, the built-in schema
    torchrec-cloud data preprocess --schema schema.yaml --input day_8.parquet --vocab_from /data/day_7 \
        --output /data/day_8                                                     # ids keep yesterday's rows
    torchrec-cloud data verify s3://bucket/criteo-1tb      # exit 1 naming a damaged shard

Many machines: ``--shares N --share_index I`` (or a Kubernetes Indexed Job's
``JOB_COMPLETION_INDEX``) converts share I of the inputs (Criteo's: of its byte ranges and
gzip files); see
:mod:`~torchrec_cloud.data.preprocess`. Bad flags end with one line naming the flag (exit 2);
bad input with ``FILE:LINE: what is wrong`` (exit 1). docs/data.md has the details.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Optional

from torchrec_cloud import counted, storage
from torchrec_cloud.config import ConfigError
from torchrec_cloud.data.criteo_format import CAT_FEATURES
from torchrec_cloud.progress import Progress, plural

CRITEO_ONLY = ("num_embeddings", "num_embeddings_per_feature", "chunk_mb")
SCHEMA_ONLY = ("split_by", "val_from", "test_from", "max_list_length", "max_id_bytes", "vocab_from")


def _sizes(ns: argparse.Namespace) -> Optional[list[int]]:
    if ns.num_embeddings is not None and ns.num_embeddings_per_feature is not None:
        raise ConfigError("num_embeddings", "give --num_embeddings or --num_embeddings_per_feature, not both")
    if ns.num_embeddings_per_feature is not None:
        sizes = [x for part in ns.num_embeddings_per_feature for x in part]
        if len(sizes) != CAT_FEATURES:
            raise ConfigError(
                "num_embeddings_per_feature",
                f"needs {CAT_FEATURES} values (one per categorical feature), got {len(sizes)}",
            )
        if min(sizes) <= 0:
            raise ConfigError("num_embeddings_per_feature", f"every value must be > 0, got {sizes}")
        return sizes
    if ns.num_embeddings is not None:
        if ns.num_embeddings <= 0:
            raise ConfigError("num_embeddings", f"must be > 0, got {ns.num_embeddings}")
        return [ns.num_embeddings] * CAT_FEATURES
    return None


def cmd_preprocess(ns: argparse.Namespace) -> int:
    if (ns.format is None) == (ns.schema is None):
        raise ConfigError("schema", "give --schema FILE (your data) or --format kaggle|terabyte (Criteo), one of them")
    if ns.output is None:
        raise ConfigError("output", "is required: the folder or URL to write the shards to")
    if ns.rows_per_shard is not None and ns.rows_per_shard <= 0:
        raise ConfigError("rows_per_shard", f"must be > 0, got {ns.rows_per_shard}")
    if ns.workers < 0:
        raise ConfigError("workers", f"must be >= 0, got {ns.workers}")
    given = [f for f in (SCHEMA_ONLY if ns.format else CRITEO_ONLY) if getattr(ns, f) is not None]
    if given:
        other = "--schema" if ns.format else "--format (Criteo)"
        raise ConfigError(given[0], f"applies with {other} only")
    if ns.schema is not None:
        return _preprocess_schema(ns)
    return _preprocess_criteo(ns)


def _share(ns: argparse.Namespace) -> Optional[tuple[int, int]]:
    """``(index, count)`` of this run's share of the inputs, or None for all of them."""
    if ns.shares is None:
        if ns.share_index is not None:
            raise ConfigError("share_index", "needs --shares N")
        return None
    if ns.shares <= 0:
        raise ConfigError("shares", f"must be > 0, got {ns.shares}")
    index = ns.share_index
    if index is None:
        env = os.environ.get("JOB_COMPLETION_INDEX")
        if env is None or not env.strip().isdigit():
            raise ConfigError("share_index", "--shares needs --share_index I (or JOB_COMPLETION_INDEX, as a Kubernetes Indexed Job sets)")
        index = int(env)
    if not 0 <= index < ns.shares:
        raise ConfigError("share_index", f"must be in 0..{ns.shares - 1}, got {index}")
    return index, ns.shares


def _preprocess_schema(ns: argparse.Namespace) -> int:
    from torchrec_cloud.data import preprocess as own
    from torchrec_cloud.data.schema import load_schema, split_from_flags
    from torchrec_cloud.data.tabular import Caps, expand

    share = _share(ns)
    defaults = Caps()
    caps = Caps(defaults.max_list_length if ns.max_list_length is None else ns.max_list_length,
                defaults.max_id_bytes if ns.max_id_bytes is None else ns.max_id_bytes).check()
    schema = load_schema(ns.schema)
    split = split_from_flags(schema, ns.split_by, ns.val_from, ns.test_from)
    inputs = expand(list(ns.input))
    opts = own.Options(schema, inputs, ns.output, split, ns.on_bad_line, ns.rows_per_shard or 500_000, caps, ns.vocab_from)
    progress = Progress("preprocess", "rows", enabled=not ns.no_progress)
    result = own.preprocess(opts, workers=ns.workers or (os.cpu_count() or 1), share=share, wait_s=ns.wait_s,
                            progress=progress)  # fmt: skip
    progress.close()
    return _report(ns, share, result)


def _preprocess_criteo(ns: argparse.Namespace) -> int:
    from torchrec_cloud.data import criteo_tsv
    from torchrec_cloud.data.preprocess import preprocess

    sizes = _sizes(ns)
    chunk_mb = 64.0 if ns.chunk_mb is None else ns.chunk_mb
    if chunk_mb <= 0:
        raise ConfigError("chunk_mb", f"must be > 0, got {ns.chunk_mb}")
    if ns.format == "terabyte" and len(ns.input) < 2:
        raise ConfigError(
            "input",
            "--format terabyte needs at least two day files: the last day is split into "
            "validation and test, the others are training data",
        )
    input_sizes = [storage.size(p) for p in ns.input]
    opts = criteo_tsv.Options(
        dataset=ns.format,
        inputs=list(ns.input),
        input_sizes=input_sizes,
        output=ns.output,
        num_embeddings_per_feature=sizes,
        on_bad_line=ns.on_bad_line,
        chunk_bytes=int(chunk_mb * (1 << 20)),
        rows_per_shard=ns.rows_per_shard or 500_000,
    )
    share = _share(ns)
    progress = Progress("preprocess", "rows", enabled=not ns.no_progress)
    result = preprocess(opts, workers=ns.workers, share=share, progress=progress)
    progress.close()
    return _report(ns, share, result)


def _report(ns: argparse.Namespace, share: Optional[tuple[int, int]], result: Any) -> int:
    """What a preprocessing run did, for either input format: a share's part, an output
    already complete, or the dataset written (its splits, vocabulary version, tables, the
    shards kept from an interrupted run, the first bad rows skipped)."""
    m = result.manifest
    criteo = ns.format is not None
    if m is None:
        index, count = share or (0, 1)
        print(f"share {index} of {count}: converted {plural(result.converted, 'task' if criteo else 'input')} in "
              f"{result.seconds:.1f}s; the manifest is written by the last share to finish (or run the command again "
              "without --shares)")  # fmt: skip
        return 0
    shape = f"{counted(m['rows'], 'row')} in {counted(len(m['shards']), 'shard')}"
    if result.already_complete:
        print(f"{ns.output} is already complete ({shape}); nothing to do")
        return 0
    rows = {k: sum(e - s for _, s, e in v) for k, v in m["splits"].items()}
    rate = m["rows"] / result.seconds if result.seconds > 0 else float("nan")
    grown = m.get("vocabulary") or {}
    if grown.get("version"):
        reset = sum(len(r) for r in grown["reset_rows"].values())
        print(f"vocabulary version {grown['version']} (from {ns.vocab_from}): {plural(reset, 'row')} given to new ids "
              "in place of evicted ones")  # fmt: skip
    tables = "" if criteo else "; tables: " + ", ".join(
        f"{n} {s}" for n, s in zip(m["features"]["sparse"], m["transforms"]["table_sizes"]))  # fmt: skip
    print(f"wrote {shape} to {ns.output} ({result.seconds:.1f}s, {rate:,.0f} rows/s; train {rows['train']}, "
          f"val {rows['val']}, test {rows['test']}){tables}")  # fmt: skip
    empty = [k for k, v in rows.items() if v == 0]
    if empty:
        print(f"note: the {' and '.join(empty)} split(s) have no rows; training needs all three"
              + ("" if criteo else " (see --split_by)"))  # fmt: skip
    if result.resumed:
        print(f"resumed: {plural(result.resumed, 'shard')} {'was' if result.resumed == 1 else 'were'} already done and kept")
    _print_skipped(m["skipped_rows"], "line" if criteo else "row", m["skipped_examples"])
    return 0


def _print_skipped(count: int, what: str, examples: list[str]) -> None:
    if count:
        print(f"skipped {plural(count, 'bad ' + what)}; first ones:")
        for line in examples[:5]:
            print(f"  {line}")


def cmd_schema(ns: argparse.Namespace) -> int:
    from torchrec_cloud.data.infer import propose
    from torchrec_cloud.data.schema import parse_schema
    from torchrec_cloud.data.tabular import expand
    from torchrec_cloud.untrusted import parse_yaml

    if ns.rows <= 0:
        raise ConfigError("rows", f"must be > 0, got {ns.rows}")
    path = expand([ns.input])[0]
    text, notes = propose(path, ns.rows)
    if "CHANGE_ME" not in text:
        parse_schema(parse_yaml(text, "the proposed schema"), "the proposed schema")  # it loads as written
    if ns.output is None:
        sys.stdout.write(text)
    else:
        storage.write_bytes(ns.output, text.encode())
        print(f"wrote {ns.output}: read it, edit it, then: torchrec-cloud data preprocess --schema {ns.output} "
              f"--input ... --output ...")  # fmt: skip
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    return 0


def cmd_verify(ns: argparse.Namespace) -> int:
    from torchrec_cloud.data.criteo_format import load_manifest, verify_shards
    from torchrec_cloud.data.dataset import check_vocabularies, is_schema_dataset, load_dataset, read_manifest, verify_files
    from torchrec_cloud.errors import CommandError

    vocab_problems: list[str] = []
    vocabularies = ""
    try:
        raw = read_manifest(ns.path)
        if is_schema_dataset(raw):
            ds = load_dataset(ns.path, raw, check_files=False)
            report = verify_files(ns.path, ds.shards)
            vocab_problems = check_vocabularies(ns.path, ds.vocab_files, ds.manifest_url)
            if not vocab_problems:  # each counts file is checked against its vocabulary's ids
                from torchrec_cloud.data.vocab import check_counts

                vocab_problems = check_counts(ns.path, raw)
            vocabularies = f" and {counted(len(ds.vocab_files), 'vocabulary file')}" if ds.vocab_files else ""
        else:
            report = verify_shards(ns.path, load_manifest(ns.path))
    except ConfigError as e:  # no manifest, or not ours: what --dataset_path would say, without the flag
        raise CommandError(str(e).removeprefix(f"--{e.flag}: ")) from None
    for problem in report["problems"] + vocab_problems:
        print(f"torchrec-cloud data verify: error: {problem}", file=sys.stderr)
    if report["problems"]:
        print(f"{len(report['problems'])} of {counted(report['shards'], 'shard')} under {ns.path} are damaged or missing; "
              "preprocess again, or copy them again", file=sys.stderr)  # fmt: skip
    if report["problems"] or vocab_problems:
        return 1
    unchecked = report["shards"] - report["checked"]
    note = f"; {unchecked} have no checksum in the manifest (sizes checked only)" if unchecked else ""
    print(f"ok: {counted(report['shards'], 'shard')}, {report['bytes']:,} bytes{vocabularies} under {ns.path} match "
          f"their manifest{note}")
    return 0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from torchrec_cloud.config import _int_list

    parser = subparsers.add_parser(
        "data", help="prepare data for training: propose a schema, preprocess Parquet/CSV or Criteo TSV into shards",
        description="Prepare data for train --dataset_path: your events (Parquet, CSV) with a schema, or Criteo's TSV.",
    )
    sub = parser.add_subparsers(dest="data_command", metavar="ACTION", parser_class=type(parser))
    sub.required = True
    sch = sub.add_parser(
        "schema",
        help="propose a schema (YAML) from a Parquet or CSV file's columns, to edit",
        description="Propose a schema from a Parquet or CSV/TSV file (local or in a bucket): the label, dense and "
        "sparse features and a split, each with a comment saying why. Edit it, then give it to data preprocess "
        "--schema. See docs/data.md.",
    )
    sch.add_argument("--input", required=True, metavar="FILE_OR_URL", help="a Parquet or CSV/TSV file (or a folder: its first file)")
    sch.add_argument("--output", default=None, metavar="FILE", help="where to write the YAML (default: print it)")
    sch.add_argument("--rows", type=int, default=100_000, help="rows to sample")
    sch.set_defaults(func=cmd_schema)
    p = sub.add_parser(
        "preprocess",
        help="convert Parquet/CSV (with --schema) or Criteo TSV (with --format) into binary shards + manifest",
        description="Convert your events (Parquet or CSV/TSV, with --schema) or Criteo Kaggle train.txt / 1TB day "
        "files (--format) into binary shards and a manifest for train --dataset_path. Local paths or s3://, gs://, "
        "az:// URLs. Resumes an interrupted run. See docs/data.md.",
    )
    p.add_argument("--schema", default=None, metavar="FILE", help="the schema of your data (YAML; see data schema)")
    p.add_argument("--format", default=None, choices=["kaggle", "terabyte"],
                   help="Criteo's built-in schema: kaggle: train.txt (last 1/7 held out for val/test); terabyte: "
                        "day_0..day_23 (the last day split into val/test)")  # fmt: skip
    p.add_argument("--input", required=True, nargs="+", metavar="FILE_OR_URL",
                   help="input files (with --schema, a folder means the .parquet/.csv/.tsv files under it), "
                        "local paths or s3:// gs:// az:// URLs")  # fmt: skip
    p.add_argument("--output", default=None, metavar="DIR_OR_URL",
                   help="folder or URL for shards and manifest.json (resumes if it holds "
                        "an interrupted run with the same settings)")
    p.add_argument("--split_by", default=None, metavar="COLUMN",
                   help="--schema: rows with COLUMN < --val_from train, < --test_from validate, the rest test; "
                        "`input`: by --input file (from the files named on); `hash:COLUMN`: by a stable hash of "
                        "COLUMN as a fraction (default: the schema's split, else 80/10/10 by row)")  # fmt: skip
    p.add_argument("--val_from", default=None, metavar="V", help="--schema: where validation starts (a value, a date, a file, a fraction)")
    p.add_argument("--test_from", default=None, metavar="T", help="--schema: where test starts")
    p.add_argument("--vocab_from", default=None, metavar="DATASET",
                   help="--schema: yesterday's dataset (a folder or URL data preprocess wrote): its ids keep their rows, "
                        "new ones are admitted by min_count and take free or evicted rows (docs/daily.md)")  # fmt: skip
    p.add_argument("--shares", type=int, default=None, metavar="N",
                   help="the inputs (Criteo's: its byte ranges and gzip files) are converted by N runs (machines, pods); "
                        "this run does one share")
    p.add_argument("--share_index", type=int, default=None, metavar="I",
                   help="this run's share, 0..N-1 (default: $JOB_COMPLETION_INDEX, a Kubernetes Indexed Job's)")
    p.add_argument("--wait_s", type=float, default=3600.0,
                   help="--shares: seconds to wait for the other shares' vocabulary counts")
    p.add_argument("--num_embeddings", type=int, default=None,
                   help="--format: take every categorical id modulo N (table rows)")
    p.add_argument("--num_embeddings_per_feature", type=_int_list, nargs="+", default=None,
                   metavar="N,N,...", help="--format: 26 table sizes, one per categorical feature")
    p.add_argument("--on_bad_line", choices=["error", "skip"], default="error",
                   help="error: stop at the first bad line or row with FILE:LINE (exit 1); "
                        "skip: leave bad ones out and report how many")
    p.add_argument("--max_list_length", type=int, default=None, metavar="N",
                   help="--schema: a row whose list holds more ids is a bad row (default 100000)")
    p.add_argument("--max_id_bytes", type=int, default=None, metavar="N",
                   help="--schema: a row with a longer text value (an id, a split key) is a bad row (default 4096)")
    p.add_argument("--workers", type=int, default=0,
                   help="processes to use (default 0: all cores)")
    p.add_argument("--chunk_mb", type=float, default=None,
                   help="--format: plain files are cut into ranges of this many MiB, one shard each (default 64)")
    p.add_argument("--rows_per_shard", type=int, default=None,
                   help="input rows per shard (--format: of gzip files) (default 500000)")
    p.add_argument("--no_progress", action="store_true", help="no progress bar or progress lines")
    p.set_defaults(func=cmd_preprocess)
    v = sub.add_parser(
        "verify",
        help="read every shard back and check its size and checksum against the manifest",
        description="Check that every shard of a preprocessed folder (local or s3://, gs://, az://) is "
        "whole and unchanged: its size, and its checksum where the manifest records one. Exit 1 naming "
        "each damaged or missing shard.",
    )
    v.add_argument("path", metavar="DIR_OR_URL", help="a folder written by data preprocess")
    v.set_defaults(func=cmd_verify)
    return parser
