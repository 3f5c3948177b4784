"""``asyncckpt convert SRC OUT``: re-encode a checkpoint, or export it as safetensors.

Typical uses: turn a GPU-only checkpoint (ANS, Bitcomp, ...) into zstd so CPU-only machines
can read it (run on a GPU machine), or hand the tensors to another tool as one
``.safetensors`` file. Every blob is verified on the way in (checksums, sizes); the output is
a normal committed checkpoint (``OUT/step-NNNNNNNNNN``, same step, structure, metadata and
devices) or a safetensors file whose ``__metadata__`` keeps the structure.

Runs on the calling thread; nvCOMP codecs need a GPU with the GPU extra, zstd and none do not.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from ..backend import CPU_ENCODERS, cpu_encoder
from ..codecs import Encoder
from ..dtypes import dtype_name
from ..errors import CheckpointError
from ..layout import resolve_checkpoint
from ..loader import load
from ..manifest import Manifest, read_manifest
from ..options import CODEC_NAMES, CheckpointOptions
from ..persist import SaveJob, persist
from ..snapshot import StagedTensor, bytes_view
from ..storage import PosixStorage, Storage
from ..tree import flatten

SAFETENSORS_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
    "uint16": "U16",
    "uint32": "U32",
    "uint64": "U64",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "convert", help="re-encode a checkpoint (e.g. ANS -> zstd for CPU readers) or export it to safetensors"
    )
    parser.add_argument("checkpoint", help="a checkpoint directory, or a run directory (its latest)")
    parser.add_argument("out", help="run directory for the new checkpoint, or the .safetensors file to write")
    parser.add_argument("--step", type=int, default=None)
    parser.add_argument(
        "--codec",
        default="zstd",
        choices=CODEC_NAMES,
        help="codec of the new checkpoint (default zstd: readable everywhere)",
    )
    parser.add_argument("--to", default="asyncckpt", choices=("asyncckpt", "safetensors"), help="output format")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    source = resolve_checkpoint(args.checkpoint, "latest" if args.step is None else args.step)
    manifest = read_manifest(source)
    if args.to == "safetensors":
        tensors = _tensors(source, manifest, torch.device("cpu"))
        size = write_safetensors(Path(args.out), manifest, tensors)
        print(f"wrote {args.out}: {len(tensors)} tensors, {size} bytes (safetensors)")
        return 0
    encoder, storage, device = _encoder_for(args.codec)
    try:
        tensors = _tensors(source, manifest, device)
        began = time.perf_counter()
        job = SaveJob(
            step=manifest.step,
            structure=manifest.structure,
            snapshot=_Decoded(manifest, tensors),
            metadata=manifest.metadata,
            created_unix=manifest.created_unix,
            started=began,
            stall_seconds=0.0,
            snapshot_seconds=0.0,
            snapshot_mode="convert",
        )
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        result = persist(job, out, encoder, storage, keep_last=None)
    finally:
        close = getattr(encoder, "close", None)
        if close is not None:
            close()
    print(
        f"wrote {result.path}: {len(tensors)} tensors, {result.raw_bytes} bytes raw, {result.stored_bytes} stored "
        f"({result.ratio:.3f}x; {', '.join(f'{k}: {v}' for k, v in sorted(result.codecs.items()))})"
    )
    return 0


def _encoder_for(codec: str) -> tuple[Encoder, Storage, torch.device]:
    """The encoder and storage for ``codec``: the CPU ones for zstd/none, the GPU pipeline otherwise."""
    if codec in CPU_ENCODERS and codec != "auto":
        return cpu_encoder(CheckpointOptions(codec=codec)), PosixStorage(), torch.device("cpu")
    from ..gpu.deps import gpu_path_available, require_cuda

    if codec == "auto" and not gpu_path_available():
        return cpu_encoder(CheckpointOptions(codec="zstd")), PosixStorage(), torch.device("cpu")
    device = require_cuda(f"converting to codec {codec!r}")
    from ..gpu.pipeline import GpuEncoder
    from ..gpu.storage import KvikioStorage

    return GpuEncoder(codec, device), KvikioStorage(device), device


def _tensors(source: Path, manifest: Manifest, device: torch.device) -> list[torch.Tensor]:
    """Every tensor of the table, verified and decoded, in table order."""
    state = load(source, map_location=device)
    tensors = [leaf.tensor for leaf in flatten(state).tensors]
    if len(tensors) != len(manifest.tensors):
        held, listed = len(tensors), len(manifest.tensors)
        raise CheckpointError(f"{source}: the structure holds {held} tensors, the table lists {listed}")
    return tensors


class _Decoded:
    """A snapshot of decoded tensors (nothing to wait for; the caller owns the memory)."""

    staging_bytes = 0
    stable = True

    def __init__(self, manifest: Manifest, tensors: list[torch.Tensor]) -> None:
        self.tensors = [
            StagedTensor(rec.key, t.dtype, tuple(t.shape), torch.device(rec.device), bytes_view(t.contiguous()))
            for rec, t in zip(manifest.tensors, tensors, strict=True)
        ]

    def wait_ready(self) -> None:
        if any(t.data.is_cuda for t in self.tensors):
            torch.cuda.synchronize()

    def release(self) -> None:
        pass

    def gpu_busy_seconds(self) -> float:
        return 0.0


def write_safetensors(path: Path, manifest: Manifest, tensors: list[torch.Tensor]) -> int:
    """Write ``tensors`` (host) under their manifest keys as one safetensors file; returns its size.

    The non-tensor structure, step and metadata go into ``__metadata__`` as JSON strings, so
    nothing of the checkpoint is lost; safetensors itself stores each tensor once.
    """
    header: dict[str, Any] = {
        "__metadata__": {
            "format": "asyncckpt",
            "step": str(manifest.step),
            "asyncckpt_structure": json.dumps(manifest.structure),
            "asyncckpt_metadata": json.dumps(manifest.metadata),
        }
    }
    offset = 0
    for record, t in zip(manifest.tensors, tensors, strict=True):
        kind = SAFETENSORS_DTYPES.get(dtype_name(t.dtype) or "")
        if kind is None:
            raise CheckpointError(f"tensor {record.key!r}: safetensors cannot store dtype {t.dtype}")
        size = t.numel() * t.element_size()
        header[record.key] = {"dtype": kind, "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    with open(path, "xb") as f:
        f.write(len(encoded).to_bytes(8, "little"))
        f.write(encoded)
        for t in tensors:
            f.write(bytes_view(t.cpu().contiguous()).numpy().tobytes())
    return 8 + len(encoded) + offset
