"""The ``export`` command: a checkpoint to one model folder (:mod:`.export`), or to a new
version of a published root, gated (:mod:`.release`)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

from torchrec_cloud.config import ConfigError
from torchrec_cloud.serving import add_command
from torchrec_cloud.serving import export as export_module
from torchrec_cloud.serving.export import FORMATS, export
from torchrec_cloud.serving.publish import DEFAULT_TOLERANCE
from torchrec_cloud.serving.release import publish
from torchrec_cloud.serving.scorer import QUANTIZE


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    summary = "export a training checkpoint to a model directory that serves (TorchScript + weights)"
    parser = add_command(subparsers, "export", summary, export_module.__doc__, _main)
    parser.add_argument("checkpoint", metavar="CHECKPOINT", help="a checkpoint, a folder of them (its newest complete one) or a run folder")
    parser.add_argument("--output", default=None, metavar="DIR", help="the model directory to write (folder or URL)")
    parser.add_argument("--publish", default=None, metavar="ROOT",
                        help="instead of --output: write a new version ROOT/VERSION/ and then point ROOT/current at it "
                             "(what `serve ROOT` follows)")  # fmt: skip
    parser.add_argument("--gate", default=None, metavar="DATASET",
                        help="with --publish: score DATASET's test split with the model ROOT/current names and with "
                             "this one, and publish only if this one's AUC is not lower by more than --tolerance "
                             "(else exit 1, current unchanged)")  # fmt: skip
    parser.add_argument("--tolerance", type=float, default=None, metavar="T",
                        help="with --gate: how much lower the new test AUC may be (default 0.002: about a retraining's "
                             "run-to-run spread, so noise alone does not hold a day's model back)")  # fmt: skip
    parser.add_argument("--format", default=None, metavar="FORMATS",
                        help="scorers to write, comma-separated: torchscript (scorer.pt), pt2 (scorer.pt2, torch.export "
                             "compiled by AOTInductor) (default: both, pt2 where it builds)")  # fmt: skip
    parser.add_argument(
        "--quantize", choices=QUANTIZE, default="none", help="store the scoring module's tables as fp16 or row-wise int8"
    )
    parser.add_argument(
        "--dataset_path", default=None,
        help="the dataset it trained on, if moved (its transforms' digest must be the checkpoint's); "
             "the quantization's AUC change is measured on it (default: the run's own)",
    )  # fmt: skip
    parser.add_argument("--eval_rows", type=int, default=1_000_000, help="validation rows to measure it on, at most")
    parser.add_argument("--json", action="store_true", help="print the model config as one JSON object")
    return parser


def parse_formats(value: Optional[str]) -> Optional[tuple[str, ...]]:
    """``--format``: None (the default) or the named formats, each once."""
    if value is None:
        return None
    names = [v.strip() for v in value.split(",") if v.strip()]
    wrong = [n for n in names if n not in FORMATS]
    if not names or wrong:
        raise ConfigError("format", f"expected a comma-separated list of {', '.join(FORMATS)}, got {value!r}")
    return tuple(dict.fromkeys(names))


def _main(ns: argparse.Namespace) -> int:
    log = (lambda line: print(line, file=sys.stderr)) if ns.json else print
    formats = parse_formats(ns.format)
    if (ns.output is None) == (ns.publish is None):
        raise ConfigError("output", "give --output DIR (one model folder) or --publish ROOT (a new version), one of them")
    if ns.publish is None and (ns.gate is not None or ns.tolerance is not None):
        raise ConfigError("gate" if ns.gate is not None else "tolerance", "checks a model before --publish ROOT makes it "
                          "current: give --publish")  # fmt: skip
    if ns.tolerance is not None and not (0 <= ns.tolerance < 1):
        raise ConfigError("tolerance", f"must be an AUC difference in [0, 1), got {ns.tolerance}")
    if ns.tolerance is not None and ns.gate is None:
        raise ConfigError("tolerance", "applies to --gate DATASET: give it")
    if ns.publish is not None:
        tolerance = DEFAULT_TOLERANCE if ns.tolerance is None else ns.tolerance
        config = publish(ns.checkpoint, ns.publish, ns.quantize, ns.dataset_path, ns.eval_rows, log, formats,
                         gate=ns.gate, tolerance=tolerance)  # fmt: skip
    else:
        config = export(ns.checkpoint, ns.output, ns.quantize, ns.dataset_path, ns.eval_rows, log, formats)
    if ns.json:
        print(json.dumps(config))
    return 0
