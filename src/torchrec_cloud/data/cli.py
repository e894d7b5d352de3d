"""``torchrec-cloud data preprocess``: Criteo TSV (plain or .gz, local or in a bucket) to the
binary shards and manifest that ``train --dataset_path`` reads; ``data verify``: every shard
of such a folder read back against the sizes and checksums in its manifest::

    torchrec-cloud data preprocess --format kaggle --input train.txt --output /data/kaggle \\
        --num_embeddings 10000000
    torchrec-cloud data verify s3://bucket/criteo-1tb      # exit 1 naming a damaged shard

Bad flags end with one line naming the flag (exit 2); bad input with ``FILE:LINE: what is
wrong`` (exit 1). See :mod:`~torchrec_cloud.data.criteo_preprocess` and docs/data.md.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Optional

from torchrec_cloud import counted, storage
from torchrec_cloud.config import ConfigError
from torchrec_cloud.data.criteo_format import CAT_FEATURES
from torchrec_cloud.data.criteo_parse import PreprocessError
from torchrec_cloud.data.criteo_preprocess import Options, preprocess


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
    sizes = _sizes(ns)
    if ns.chunk_mb <= 0:
        raise ConfigError("chunk_mb", f"must be > 0, got {ns.chunk_mb}")
    if ns.rows_per_shard <= 0:
        raise ConfigError("rows_per_shard", f"must be > 0, got {ns.rows_per_shard}")
    if ns.workers < 0:
        raise ConfigError("workers", f"must be >= 0, got {ns.workers}")
    if ns.format == "terabyte" and len(ns.input) < 2:
        raise ConfigError(
            "input",
            "--format terabyte needs at least two day files: the last day is split into "
            "validation and test, the others are training data",
        )
    try:
        input_sizes = [storage.size(p) for p in ns.input]
        opts = Options(
            dataset=ns.format,
            inputs=list(ns.input),
            input_sizes=input_sizes,
            output=ns.output,
            num_embeddings_per_feature=sizes,
            on_bad_line=ns.on_bad_line,
            chunk_bytes=int(ns.chunk_mb * (1 << 20)),
            rows_per_shard=ns.rows_per_shard,
        )
        result = preprocess(opts, workers=ns.workers, progress=not ns.no_progress)
    except (PreprocessError, storage.StorageError) as e:
        print(f"torchrec-cloud data preprocess: error: {e}", file=sys.stderr)
        return 1
    m = result.manifest
    if result.already_complete:
        print(f"{ns.output} is already complete ({counted(m['rows'], 'row')} in {counted(len(m['shards']), 'shard')}); "
              "nothing to do")
        return 0
    rate = m["rows"] / result.seconds if result.seconds > 0 else float("nan")
    print(
        f"wrote {counted(m['rows'], 'row')} in {counted(len(m['shards']), 'shard')} to {ns.output} "
        f"({result.seconds:.1f}s, {rate:,.0f} rows/s; train {sum(e - s for _, s, e in m['splits']['train'])}, "
        f"val {sum(e - s for _, s, e in m['splits']['val'])}, test {sum(e - s for _, s, e in m['splits']['test'])})"
    )
    if result.resumed_shards:
        print(f"resumed: {result.resumed_shards} shard(s) were already done and kept")
    if m["skipped_lines"]:
        print(f"skipped {m['skipped_lines']} bad line(s); first ones:")
        for line in m["skipped_examples"][:5]:
            print(f"  {line}")
    return 0


def cmd_verify(ns: argparse.Namespace) -> int:
    from torchrec_cloud.data.criteo_format import load_manifest, verify_shards

    try:
        manifest = load_manifest(ns.path)
        report = verify_shards(ns.path, manifest)
    except storage.StorageError as e:
        print(f"torchrec-cloud data verify: error: {e}", file=sys.stderr)
        return 1
    except ConfigError as e:  # no manifest, or not ours: what --dataset_path would say, without the flag
        print(f"torchrec-cloud data verify: error: {str(e).removeprefix(f'--{e.flag}: ')}", file=sys.stderr)
        return 1
    for problem in report["problems"]:
        print(f"torchrec-cloud data verify: error: {problem}", file=sys.stderr)
    if report["problems"]:
        print(f"{len(report['problems'])} of {counted(report['shards'], 'shard')} under {ns.path} are damaged or missing; "
              "preprocess again, or copy them again", file=sys.stderr)  # fmt: skip
        return 1
    unchecked = report["shards"] - report["checked"]
    note = f"; {unchecked} have no checksum in the manifest (sizes checked only)" if unchecked else ""
    print(f"ok: {counted(report['shards'], 'shard')}, {report['bytes']:,} bytes under {ns.path} match their "
          f"manifest{note}")
    return 0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from torchrec_cloud.config import _int_list

    parser = subparsers.add_parser(
        "data", help="prepare Criteo data for training (preprocess TSV into binary shards)",
        description="Prepare Criteo data for --dataset_path.",
    )
    sub = parser.add_subparsers(dest="data_command", metavar="ACTION", parser_class=type(parser))
    sub.required = True
    p = sub.add_parser(
        "preprocess",
        help="convert Criteo Kaggle/1TB TSV (plain or .gz) into binary shards + manifest",
        description="Convert Criteo Kaggle train.txt or 1TB day files (plain or .gz, local "
        "or in a bucket) into binary shards and a manifest for train --dataset_path. "
        "See docs/data.md for the format.",
    )
    p.add_argument("--format", required=True, choices=["kaggle", "terabyte"],
                   help="kaggle: train.txt (last 1/7 held out for val/test); terabyte: "
                        "day_0..day_23 (the last day split into val/test)")
    p.add_argument("--input", required=True, nargs="+", metavar="FILE_OR_URL",
                   help="TSV files, plain or .gz, local paths or s3:// gs:// az:// URLs")
    p.add_argument("--output", required=True, metavar="DIR_OR_URL",
                   help="folder or URL for shards and manifest.json (resumes if it holds "
                        "an interrupted run with the same settings)")
    p.add_argument("--num_embeddings", type=int, default=None,
                   help="take every categorical id modulo N (table rows)")
    p.add_argument("--num_embeddings_per_feature", type=_int_list, nargs="+", default=None,
                   metavar="N,N,...", help="26 table sizes, one per categorical feature")
    p.add_argument("--on_bad_line", choices=["error", "skip"], default="error",
                   help="error: stop at the first bad line with FILE:LINE (exit 1); "
                        "skip: leave bad lines out and report how many")
    p.add_argument("--workers", type=int, default=0,
                   help="processes to use (default 0: all cores)")
    p.add_argument("--chunk_mb", type=float, default=64.0,
                   help="plain files are cut into ranges of this many MiB, one shard each")
    p.add_argument("--rows_per_shard", type=int, default=500_000,
                   help="gzip files: input lines per shard")
    p.add_argument("--no_progress", action="store_true", help="no progress bar")
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
