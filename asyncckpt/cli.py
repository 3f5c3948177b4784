"""The ``asyncckpt`` command line: one module per subcommand under :mod:`asyncckpt._commands`.

Each module defines ``register(subparsers)``, which adds its parser and sets ``func`` to a
callable taking the parsed arguments and returning an exit status. Add a command by adding a
module and its name to :data:`COMMANDS`.

Exit status, the same for every command:

* 0: done (``verify``: every checksum matched);
* 1: a checkpoint was read and found corrupt (``verify``, ``ls`` with a bad row, ``inspect``
  and ``convert`` of a checkpoint whose manifest or data fail their checks);
* 2: it could not run: a bad argument, a missing or odd path (a file where a directory is
  expected), no checkpoint there, a missing dependency, an I/O error; one line on stderr;
* 130: interrupted (Ctrl-C); 141: its output pipe closed early (``asyncckpt inspect X | head``),
  which is what a shell reports for a tool stopped by SIGPIPE; nothing is printed.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence

from ._version import __version__
from .errors import CheckpointError, CorruptCheckpointError

COMMANDS = ("demo", "ls", "inspect", "verify", "convert", "bench")

EXIT_OK, EXIT_CORRUPT, EXIT_ERROR, EXIT_INTERRUPTED, EXIT_BROKEN_PIPE = 0, 1, 2, 130, 141


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asyncckpt",
        description="Asynchronous compressed checkpoints for PyTorch.",
        epilog="exit status: 0 done, 1 a checkpoint is corrupt, 2 could not run (argument, path, dependency)",
    )
    parser.add_argument("--version", action="version", version=_version())
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the worker does")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"asyncckpt._commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"asyncckpt._commands.{name}":
                raise
            continue  # a command whose module is not part of this build
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    if args.command is None:
        parser.print_help()
        return EXIT_OK
    try:
        status: int = args.func(args)
        sys.stdout.flush()  # a closed pipe shows up here for output still buffered
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        print("asyncckpt: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except CorruptCheckpointError as exc:
        print(f"asyncckpt: corrupt checkpoint: {exc}", file=sys.stderr)
        return EXIT_CORRUPT
    except (CheckpointError, OSError) as exc:
        print(f"asyncckpt: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_ERROR
    return status


def _version() -> str:
    import torch

    cuda = torch.version.cuda or "none"
    return f"asyncckpt {__version__} (torch {torch.__version__}, CUDA build {cuda})"


def _one_line(exc: BaseException) -> str:
    text = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    if isinstance(exc, OSError) and exc.filename is not None and str(exc.filename) not in text:
        text = f"{exc.filename}: {text}"
    return text


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not raise BrokenPipeError again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is not a file descriptor (an in-process caller's buffer)
        pass
    finally:
        os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
