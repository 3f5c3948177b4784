"""``asyncckpt inspect CKPT``: the tensor table of one checkpoint."""

from __future__ import annotations

import argparse
from typing import Any

from ..layout import resolve_checkpoint
from ..manifest import read_manifest


def register(sub: Any) -> None:
    parser = sub.add_parser("inspect", help="show a checkpoint's tensor table (dtype, shape, codec, ratio)")
    parser.add_argument("checkpoint", help="a checkpoint directory, or a run directory (its latest)")
    parser.add_argument("--step", type=int, default=None)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    path = resolve_checkpoint(args.checkpoint, "latest" if args.step is None else args.step)
    manifest = read_manifest(path)
    print(f"{path}: step {manifest.step}, format v{manifest.format_version}, written by asyncckpt "
          f"{manifest.library_version} ({manifest.io_mode} I/O)")  # fmt: skip
    if manifest.metadata:
        print(f"metadata: {manifest.metadata}")
    width = max([len(t.key) for t in manifest.tensors] + [3])
    print(f"{'key':{width}}  {'dtype':14}  {'shape':18}  {'device':8}  {'codec':8}  {'raw bytes':>12}  {'ratio':>6}")
    for t in manifest.tensors:
        ratio = t.raw_bytes / t.stored_bytes if t.stored_bytes else 1.0
        print(f"{t.key:{width}}  {t.dtype:14}  {tuple(t.shape)!s:18}  {t.device:8}  {t.codec:8}  "
              f"{t.raw_bytes:>12}  {ratio:>6.3f}")  # fmt: skip
    total = manifest.raw_bytes / manifest.stored_bytes if manifest.stored_bytes else 1.0
    print(f"{len(manifest.tensors)} tensors, {manifest.raw_bytes} bytes raw, {manifest.stored_bytes} stored "
          f"({total:.3f}x)")  # fmt: skip
    return 0
