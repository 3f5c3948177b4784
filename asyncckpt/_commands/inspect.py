"""``asyncckpt inspect CKPT``: the tensor table of one checkpoint (``--json`` for scripts)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from .._manifest import read_manifest
from ._json import print_json
from ._paths import checkpoint_path


def register(sub: Any) -> None:
    parser = sub.add_parser("inspect", help="show a checkpoint's tensor table (dtype, shape, codec, ratio)")
    parser.add_argument("checkpoint", help="a checkpoint directory, or a run directory (its latest)")
    parser.add_argument("--step", type=int, default=None)
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    path = checkpoint_path(args.checkpoint, args.step)
    manifest = read_manifest(path)
    if args.json:
        fields = ("step", "format_version", "library_version", "io_mode", "created_unix", "metadata", "raw_bytes")
        document = {key: getattr(manifest, key) for key in (*fields, "stored_bytes")}
        document["reference"] = dataclasses.asdict(manifest.reference) if manifest.reference else None
        print_json({"path": str(path), **document, "tensors": [dataclasses.asdict(t) for t in manifest.tensors]})
        return 0
    print(f"{path}: step {manifest.step}, format v{manifest.format_version}, written by asyncckpt "
          f"{manifest.library_version} ({manifest.io_mode} I/O)")  # fmt: skip
    if manifest.metadata:
        print(f"metadata: {manifest.metadata}")
    if manifest.reference is not None:
        print(f"incremental: delta records refer to step {manifest.reference.step} (codec column: op+codec)")
    width = max([len(t.key) for t in manifest.tensors] + [3])
    print(f"{'key':{width}}  {'dtype':14}  {'shape':18}  {'device':8}  {'codec':8}  {'raw bytes':>12}  {'ratio':>6}")
    for t in manifest.tensors:
        ratio = t.raw_bytes / t.stored_bytes if t.stored_bytes else 1.0
        print(f"{t.key:{width}}  {t.dtype:14}  {tuple(t.shape)!s:18}  {t.device:8}  "
              f"{(t.delta + '+' if t.delta else '') + t.codec:8}  {t.raw_bytes:>12}  {ratio:>6.3f}")  # fmt: skip
    total = manifest.raw_bytes / manifest.stored_bytes if manifest.stored_bytes else 1.0
    print(f"{len(manifest.tensors)} tensors, {manifest.raw_bytes} bytes raw, {manifest.stored_bytes} stored "
          f"({total:.3f}x)")  # fmt: skip
    return 0
