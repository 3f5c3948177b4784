"""``asyncckpt verify CKPT``: check every checksum and that every blob decodes."""

from __future__ import annotations

import argparse
from typing import Any

from ..errors import CorruptCheckpointError
from ..loader import verify


def register(sub: Any) -> None:
    parser = sub.add_parser("verify", help="verify a checkpoint's checksums and structure")
    parser.add_argument("checkpoint", help="a checkpoint directory, or a run directory (its latest)")
    parser.add_argument("--step", type=int, default=None)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        report = verify(args.checkpoint, "latest" if args.step is None else args.step)
    except CorruptCheckpointError as exc:
        print(f"CORRUPT: {exc}")
        return 1
    print(f"OK: {report.path} (step {report.step}): {report.tensors} tensors, {report.raw_bytes} bytes raw, "
          f"{report.stored_bytes} stored, every checksum verified")  # fmt: skip
    return 0
