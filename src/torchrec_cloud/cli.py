"""The ``torchrec-cloud`` command line (also ``python -m torchrec_cloud``).

Each sub-command lives in its own module, which exposes ``add_parser(subparsers)``
returning the parser it added, with ``func`` set to a callable taking the parsed
namespace and returning an exit code::

    torchrec-cloud train --preset quickstart --output_dir runs/q
    torchrun --nproc_per_node=2 -m torchrec_cloud train --preset quickstart
    torchrec-cloud bench --json

Bad flags and bad values end with one line naming the flag and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional

from torchrec_cloud.config import ConfigError

# Sub-command modules, in the order ``--help`` lists them.
COMMANDS = [
    "torchrec_cloud.train",
    "torchrec_cloud.bench",
    "torchrec_cloud.criteo",
    "torchrec_cloud.checkpoint",
]


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are a single line (no usage block), exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="torchrec-cloud",
        description="Train DLRM/DCNv2 recommendation models with TorchRec, locally or in the cloud.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    sub.required = True
    for name in COMMANDS:
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return int(ns.func(ns) or 0)
    except ConfigError as e:
        prog = f"torchrec-cloud {ns.command}"
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
