"""The ``torchrec-cloud`` command line (also ``python -m torchrec_cloud``).

Each sub-command lives in its own module, which exposes ``add_parser(subparsers)``
returning the parser it added, with ``func`` set to a callable taking the parsed
namespace and returning an exit code::

    torchrec-cloud train --preset quickstart --output_dir runs/q
    torchrun --standalone --nproc_per_node=2 -m torchrec_cloud train --preset quickstart
    torchrec-cloud bench --json

Bad flags and bad values end with one line naming the flag and exit code 2; what storage,
a damaged checkpoint or bad input did (a :class:`~torchrec_cloud.errors.CommandError`),
with one line ``torchrec-cloud COMMAND [ACTION]: error: ...`` saying what and where, and
exit code 1: :func:`main` is the one place that turns errors into lines. Every
flag is accepted as ``--flag_name`` or ``--flag-name``; abbreviations are refused
(:class:`~torchrec_cloud.config.FlagParser`).
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from typing import Optional

from torchrec_cloud import __version__, install_extra
from torchrec_cloud.config import ConfigError, FlagParser
from torchrec_cloud.errors import CommandError
from torchrec_cloud.launch import EXIT_CONFIG, EXIT_FAILED, end_pod

# Sub-command name -> module, in the order ``--help`` lists them. Only the module of the
# command being run is imported, so `render` or `report` do not wait for torch to load,
# and `torchrec-cloud --help` imports none of them.
COMMANDS = {
    "train": "torchrec_cloud.train",
    "bench": "torchrec_cloud.bench",
    "report": "torchrec_cloud.report",
    "plan": "torchrec_cloud.plan",
    "render": "torchrec_cloud.deploy.render",
    "submit": "torchrec_cloud.deploy.submit",
    "data": "torchrec_cloud.data.cli",
    "checkpoint": "torchrec_cloud.checkpoint.cli",
    "export": "torchrec_cloud.serving.export_cli",
    "predict": "torchrec_cloud.serving.predict",
    "serve": "torchrec_cloud.serving.server",
    "launch": "torchrec_cloud.launch",
    "rehearse": "torchrec_cloud.rehearse",
}

# What `torchrec-cloud --help` says of each command (every command has a line here: the
# top-level help imports no command's module).
SUMMARIES = {
    "train": "train a DLRM/DCNv2 model",
    "bench": "measure training throughput against a plain-PyTorch DLRM and the compute bound",
    "report": "plot loss, AUC and samples/s of one or more runs and print a summary",
    "plan": "TorchRec's sharding plan for a cluster: does the model fit, where each table goes",
    "render": "render Kubernetes manifests (Indexed Job, PyTorchJob, TrainJob) for a cloud",
    "submit": "submit a training job to Kubernetes (kubectl), Azure ML or Vertex AI",
    "data": "prepare data for training: propose a schema, preprocess Parquet/CSV or Criteo TSV into shards",
    "checkpoint": "list and inspect checkpoints (a run folder, a local folder or s3://, gs://, az:// URL)",
    "export": "export a training checkpoint to a model directory that serves (TorchScript + weights)",
    "predict": "score a dataset with an exported model: one click probability per row, AUC and log loss",
    "serve": "serve an exported model over HTTP (KServe v1/v2 protocols): raw rows in, probabilities out",
    "launch": "torchrun for Kubernetes pods: same flags, exit codes a controller can act on",
    "rehearse": "run a rendered job's pods on this machine under its controller's rules, with faults",
}

# Optional packages -> the extra of this package that installs them.
EXTRAS = {
    "matplotlib": "report",
    "jinja2": "deploy",
    "yaml": "deploy",
    "fsspec": "cloud",
    "s3fs": "cloud",
    "gcsfs": "cloud",
    "adlfs": "cloud",
    "starlette": "serve",
    "uvicorn": "serve",
}


class OneLineParser(FlagParser):
    """An ArgumentParser whose errors are a single line (no usage block), exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        end_pod(EXIT_CONFIG)  # under `torchrec-cloud launch`: no restart can fix a flag
        self.exit(EXIT_CONFIG, f"{self.prog}: error: {message} (see --help)\n")


def plain(text: Optional[str]) -> Optional[str]:
    """A module docstring as ``--help`` shows it, without reST's markup: double backquotes
    become single ones, a role (:mod:, :func:, ...) its target, a closing "::" a colon."""
    if not text:
        return text
    text = re.sub(r":(?:mod|func|class|meth|attr|data|exc):`~?([^`]+)`", r"`\1`", text)
    text = re.sub(r"``([^`]+)``", r"`\1`", text)
    return re.sub(r"[ \t]*::$", ":", text, flags=re.M)


def _plain_help(parser: argparse.ArgumentParser) -> None:
    """``plain`` on the texts of ``parser``, its groups and its sub-commands' parsers."""
    parser.description, parser.epilog = plain(parser.description), plain(parser.epilog)
    for group in parser._action_groups:
        group.description = plain(group.description)
    for action in parser._actions:
        if action.help and action.help != argparse.SUPPRESS:
            action.help = plain(action.help)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                _plain_help(sub)


def version() -> str:
    """This package's version and the stack's, read from the installed metadata (no imports)."""
    from torchrec_cloud.compat import installed_stack

    found = [f"{dist} {v}" for dist, v in installed_stack().items()]
    return f"torchrec-cloud {__version__}" + (f" ({', '.join(found)})" if found else "")


def build_parser(argv: Optional[list[str]] = None) -> FlagParser:
    """The full parser: the command named in ``argv`` with all its flags, the others by name."""
    parser = OneLineParser(
        prog="torchrec-cloud",
        description="Train DLRM/DCNv2 recommendation models with TorchRec, locally or in the cloud.",
    )
    parser.add_argument("--version", action="version", version=version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    sub.required = True
    first = next((a for a in argv or [] if not a.startswith("-")), None)
    for name, module in COMMANDS.items():
        if name == first:
            _plain_help(importlib.import_module(module).add_parser(sub))
        else:  # named for --help and for errors; parsing it again would import the module
            sub.add_parser(name, help=SUMMARIES[name], add_help=False)
    _name_commands(parser)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    name = _command(argv)
    try:
        parser = build_parser(argv)
        ns = parser.parse_args(argv)
        name = getattr(ns, "command_name", name)
        return int(ns.func(ns) or 0)
    except ConfigError as e:
        print(f"torchrec-cloud {name}: error: {e}", file=sys.stderr)
        end_pod(EXIT_CONFIG)
        return EXIT_CONFIG
    except CommandError as e:  # storage, a checkpoint, a model, input data: the message says what and where
        print(f"torchrec-cloud {name}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return EXIT_FAILED
    except ModuleNotFoundError as e:
        extra = EXTRAS.get((e.name or "").split(".")[0])
        if extra is None:
            raise
        print(f"torchrec-cloud {name}: error: needs {e.name}: {install_extra(extra)}", file=sys.stderr)
        return EXIT_CONFIG


def _command(argv: list[str]) -> str:
    return next((a for a in argv if a in COMMANDS), "")


def _name_commands(parser: argparse.ArgumentParser, prefix: str = "") -> None:
    """Every (sub-)command's parser sets ``command_name`` (``data preprocess``, ``checkpoint
    ls``): the name its errors are printed with."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                full = f"{prefix} {name}".strip()
                sub.set_defaults(command_name=full)
                _name_commands(sub, full)
