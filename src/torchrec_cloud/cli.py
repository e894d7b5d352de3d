"""The ``torchrec-cloud`` command line (also ``python -m torchrec_cloud``).

Each sub-command lives in its own module, which exposes ``add_parser(subparsers)``
returning the parser it added, with ``func`` set to a callable taking the parsed
namespace and returning an exit code::

    torchrec-cloud train --preset quickstart --output_dir runs/q
    torchrun --nproc_per_node=2 -m torchrec_cloud train --preset quickstart
    torchrec-cloud bench --json

Bad flags and bad values end with one line naming the flag and exit code 2; what storage
or a damaged checkpoint did, with one line saying what and where, and exit code 1.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional

from torchrec_cloud.checkpoint.store import CheckpointError
from torchrec_cloud.compat import CompatError
from torchrec_cloud.config import ConfigError
from torchrec_cloud.launch import EXIT_CONFIG, EXIT_FAILED, end_pod
from torchrec_cloud.storage import StorageError

# Errors whose message names what failed and where: one line and exit 1, no traceback.
ONE_LINE_ERRORS = (StorageError, CheckpointError, CompatError)

# Sub-command name -> module, in the order ``--help`` lists them. Only the module of the
# command being run is imported, so `render` or `report` do not wait for torch to load.
COMMANDS = {
    "train": "torchrec_cloud.train",
    "bench": "torchrec_cloud.bench",
    "report": "torchrec_cloud.report",
    "render": "torchrec_cloud.deploy.render",
    "submit": "torchrec_cloud.deploy.submit",
    "data": "torchrec_cloud.data.cli",
    "checkpoint": "torchrec_cloud.checkpoint.cli",
    "launch": "torchrec_cloud.launch",
    "rehearse": "torchrec_cloud.rehearse",
}


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are a single line (no usage block), exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        end_pod(EXIT_CONFIG)  # under `torchrec-cloud launch`: no restart can fix a flag
        self.exit(EXIT_CONFIG, f"{self.prog}: error: {message} (see --help)\n")


def build_parser(argv: Optional[list[str]] = None) -> argparse.ArgumentParser:
    """The full parser, or (given ``argv`` naming a command) one with only that command."""
    parser = OneLineParser(
        prog="torchrec-cloud",
        description="Train DLRM/DCNv2 recommendation models with TorchRec, locally or in the cloud.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    sub.required = True
    first = next((a for a in argv or [] if not a.startswith("-")), None)
    chosen = [first] if first in COMMANDS else list(COMMANDS)
    for name in chosen:
        importlib.import_module(COMMANDS[name]).add_parser(sub)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    ns = parser.parse_args(argv)
    try:
        return int(ns.func(ns) or 0)
    except ConfigError as e:
        prog = f"torchrec-cloud {ns.command}"
        print(f"{prog}: error: {e}", file=sys.stderr)
        end_pod(EXIT_CONFIG)
        return EXIT_CONFIG
    except ONE_LINE_ERRORS as e:  # what storage or a damaged checkpoint did: the message says what and where
        print(f"torchrec-cloud {ns.command}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
