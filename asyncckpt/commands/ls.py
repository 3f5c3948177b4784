"""``asyncckpt ls DIR``: the committed checkpoints of a run directory."""

from __future__ import annotations

import argparse
import time
from typing import Any

from ..layout import latest_step, list_checkpoints
from ..manifest import read_manifest


def register(sub: Any) -> None:
    parser = sub.add_parser("ls", help="list the committed checkpoints of a run directory")
    parser.add_argument("directory")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    checkpoints = list_checkpoints(args.directory)
    if not checkpoints:
        print(f"{args.directory}: no committed checkpoints")
        return 1
    latest = latest_step(args.directory)
    print(f"{'step':>10}  {'created (UTC)':19}  {'raw MB':>10}  {'stored MB':>10}  {'ratio':>6}  path")
    for info in checkpoints:
        manifest = read_manifest(info.path)
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(manifest.created_unix))
        ratio = manifest.raw_bytes / manifest.stored_bytes if manifest.stored_bytes else 1.0
        mark = "  <- latest" if info.step == latest else ""
        print(f"{info.step:>10}  {created:19}  {manifest.raw_bytes / 1e6:>10.2f}  {manifest.stored_bytes / 1e6:>10.2f}"
              f"  {ratio:>6.3f}  {info.path}{mark}")  # fmt: skip
    return 0
