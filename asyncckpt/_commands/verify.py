"""``asyncckpt verify CKPT``: check every checksum, that every blob decodes, and the structure.

Runs :func:`asyncckpt.verify` (the library's checks, unchanged) with a progress bar on a terminal.
Exit status 0 when all pass, 1 when the checkpoint is corrupt (``CORRUPT: ...`` on stdout, naming
the tensor and file), 2 when it could not run. Calling thread.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from .._loader import verify
from ..errors import CorruptCheckpointError
from ._json import print_json
from ._paths import existing_directory, stored_bytes
from ._progress import ReadProgress


def register(sub: Any) -> None:
    parser = sub.add_parser("verify", help="verify a checkpoint's checksums and structure")
    parser.add_argument("checkpoint", help="a checkpoint directory, or a run directory (its latest)")
    parser.add_argument("--step", type=int, default=None)
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of a line")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    existing_directory(args.checkpoint, "checkpoint or run directory")
    try:
        with ReadProgress("verify", stored_bytes(args.checkpoint, args.step)):
            report = verify(args.checkpoint, "latest" if args.step is None else args.step)
    except CorruptCheckpointError as exc:
        if args.json:
            print_json({"ok": False, "checkpoint": args.checkpoint, "error": str(exc)})
        else:
            print(f"CORRUPT: {exc}")
        return 1
    if args.json:
        print_json({"ok": True, **dataclasses.asdict(report), "notes": report.notes})
        return 0
    notes = "".join(f"; {note}" for note in report.notes)  # e.g. "no manifest digest (format v1)"
    print(f"OK: {report.path} (step {report.step}): {report.tensors} tensors, {report.raw_bytes} bytes raw, "
          f"{report.stored_bytes} stored, every checksum verified{notes}")  # fmt: skip
    return 0
