"""The ``asyncckpt`` command line: one module per subcommand under :mod:`asyncckpt.commands`.

Each module defines ``register(subparsers)``, which adds its parser and sets ``func`` to a
callable taking the parsed arguments and returning an exit status. Add a command by adding a
module and its name to :data:`COMMANDS`.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from .errors import CheckpointError

COMMANDS = ("demo", "ls", "inspect", "verify", "convert", "bench")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncckpt", description="Asynchronous compressed checkpoints for PyTorch.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the worker does")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"asyncckpt.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"asyncckpt.commands.{name}":
                raise
            continue  # a command whose module is not part of this build
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    if args.command is None:
        args = parser.parse_args(["demo", *(argv or [])])  # the demo is the default command
    try:
        status: int = args.func(args)
    except CheckpointError as exc:
        print(f"asyncckpt: error: {exc}", file=sys.stderr)
        return 2
    return status


if __name__ == "__main__":
    sys.exit(main())
