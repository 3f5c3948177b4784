"""``asyncckpt ls DIR``: the committed checkpoints of a run directory, one row each.

The ``base`` column says ``full``, or ``delta:N`` for an incremental checkpoint whose delta
records refer to step N (``--json``: ``delta``, ``base_step``, ``delta_tensors``).

A checkpoint whose manifest cannot be read or fails validation is reported in its own row
(``CORRUPT: ...``) and the listing goes on; the exit status is then 1 (see :mod:`asyncckpt.cli`).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from .._layout import latest_step, list_checkpoints
from .._manifest import read_manifest
from ..errors import CheckpointError
from ._json import print_json
from ._paths import existing_directory


def register(sub: Any) -> None:
    parser = sub.add_parser("ls", help="list the committed checkpoints of a run directory")
    parser.add_argument("directory", help="a run directory (the one given to AsyncCheckpointer)")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    parser.set_defaults(func=run)


def rows(directory: str) -> list[dict[str, Any]]:
    """One dict per committed checkpoint, oldest first; a bad one has ``error`` set and no sizes."""
    latest = latest_step(directory)
    out = []
    for info in list_checkpoints(directory):
        row: dict[str, Any] = {"step": info.step, "path": str(info.path), "latest": info.step == latest}
        try:
            manifest = read_manifest(info.path)
        except (CheckpointError, OSError) as exc:  # report it in its row; the other checkpoints still list
            row["error"] = " ".join(str(exc).split())
        else:
            stored = manifest.stored_bytes
            reference = manifest.reference
            row.update(created_unix=manifest.created_unix, raw_bytes=manifest.raw_bytes, stored_bytes=stored,
                       ratio=manifest.raw_bytes / stored if stored else 1.0, tensors=len(manifest.tensors),
                       delta=manifest.is_delta, base_step=reference.step if reference else None,
                       delta_tensors=sum(1 for t in manifest.tensors if t.delta is not None))  # fmt: skip
        out.append(row)
    return out


def run(args: argparse.Namespace) -> int:
    existing_directory(args.directory, "run directory")
    found = rows(args.directory)
    status = 1 if any("error" in row for row in found) else 0
    if args.json:
        print_json({"directory": args.directory, "checkpoints": found})
        return status
    if not found:
        print(f"{args.directory}: no committed checkpoints")
        return 0
    print(f"{'step':>10}  {'created (UTC)':19}  {'raw MB':>10}  {'stored MB':>10}  {'ratio':>6}  {'base':>10}  path")
    for row in found:
        mark = "  <- latest" if row["latest"] else ""
        if "error" in row:
            print(f"{row['step']:>10}  CORRUPT: {row['error']}  {row['path']}{mark}")
            continue
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(row["created_unix"]))
        base = "full" if row["base_step"] is None else f"delta:{row['base_step']}"
        print(f"{row['step']:>10}  {created:19}  {row['raw_bytes'] / 1e6:>10.2f}  {row['stored_bytes'] / 1e6:>10.2f}"
              f"  {row['ratio']:>6.3f}  {base:>10}  {row['path']}{mark}")  # fmt: skip
    return status
