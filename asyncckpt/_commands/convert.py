"""``asyncckpt convert SRC OUT``: re-encode a checkpoint, or export it as safetensors or a ``torch.save`` file.

Typical uses: turn a GPU-only checkpoint (ANS, Bitcomp, ...) into zstd so CPU-only machines
can read it (run on a GPU machine), or hand the weights to another tool. Every blob is verified
on the way in (checksums, sizes; a progress bar on a terminal); the output is

* ``--to asyncckpt`` (default): a normal committed checkpoint (``OUT/step-NNNNNNNNNN``, same step,
  structure, metadata and devices), in a codec this machine can write (``--codec``; the GPU
  codecs are offered only where CUDA and the GPU extra are present);
* ``--to safetensors``: ``OUT`` written with the safetensors library, keys as in a state dict
  (``layer.weight``), so ``model.load_state_dict(safetensors.torch.load_file(OUT))`` works. By
  default the ``model`` (or ``state_dict``) entry of the state is exported when there is one,
  else every tensor; ``--key`` picks another entry (``--key optim``). Tied weights are each
  written under their own key (safetensors stores no aliases). Non-tensor values are dropped;
  step and checkpoint metadata go into the file's ``__metadata__``;
* ``--to torch``: ``OUT`` written by ``torch.save`` (the whole state, or ``--key``'s entry),
  readable with ``torch.load(OUT, weights_only=True)``; tied tensors stay tied.

Runs on the calling thread; nvCOMP codecs need a GPU with the GPU extra, zstd and none do not.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from .._backend import cpu_encoder
from .._codecs import Encoder
from .._layout import checkpoint_name
from .._loader import load
from .._manifest import Manifest, read_manifest
from .._persist import SaveJob, persist_to
from .._snapshot import StagedAtOnce, StagedTensor, bytes_view
from .._storage import PosixStorage, Storage
from .._tree import flatten
from ..errors import CheckpointError
from ..options import CODEC_NAMES, CheckpointOptions
from ._paths import checkpoint_path
from ._progress import ReadProgress

CPU_CODECS = ("zstd", "none")
MODEL_KEYS = ("model", "state_dict")  # what a training loop (and Lightning) calls the weights


def writable_codecs() -> tuple[str, ...]:
    """Codecs this machine can write: zstd and none everywhere, nvCOMP's where the GPU path is installed."""
    from .._gpu.deps import gpu_path_installed

    return CODEC_NAMES if gpu_path_installed() else CPU_CODECS


def register(sub: Any) -> None:
    codecs = writable_codecs()
    gpu_note = (
        "" if codecs == CODEC_NAMES else "; nvCOMP codecs (lz4, deflate, ans, ...) need a CUDA GPU and the GPU extra"
    )
    parser = sub.add_parser(
        "convert",
        help="re-encode a checkpoint (e.g. ANS -> zstd for CPU readers) or export it to safetensors / torch.save",
    )
    parser.add_argument("checkpoint", help="a checkpoint directory, or a run directory (its latest)")
    parser.add_argument(
        "out", help="run directory for the new checkpoint, or the file to write (--to safetensors|torch)"
    )
    parser.add_argument("--step", type=int, default=None)
    parser.add_argument("--codec", default="zstd", choices=codecs,
                        help=f"codec of the new checkpoint (default zstd: readable everywhere{gpu_note})")  # fmt: skip
    parser.add_argument(
        "--to", default="asyncckpt", choices=("asyncckpt", "safetensors", "torch"), help="output format"
    )
    parser.add_argument("--key", default=None,
                        help="export only this entry of the state (dotted path, e.g. model or optim.state); "
                             "safetensors default: 'model' or 'state_dict' when present")  # fmt: skip
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    source = checkpoint_path(args.checkpoint, args.step)
    if args.to != "asyncckpt":
        out = Path(args.out)
        if out.exists():
            raise CheckpointError(f"{out}: already exists; remove it or choose another output file")
        manifest, state = _read(source, "cpu")
        key = args.key if args.key is not None or args.to == "torch" else _model_key(state)
        chosen = _entry(state, key) if key is not None else state
        if args.to == "torch":
            torch.save(chosen, out)
            print(f"wrote {out}: {'entry ' + repr(key) if key else 'the whole state'} (torch.save)")
            return 0
        flat = state_dict_tensors(chosen)
        write_safetensors(out, flat, manifest, key)
        what = f"entry {key!r}" if key is not None else "every tensor"
        print(f"wrote {out}: {len(flat)} tensors of {what}, {out.stat().st_size} bytes (safetensors)")
        return 0
    encoder, storage, device = _encoder_for(args.codec)
    try:
        manifest, state = _read(source, device)
        tensors = [leaf.tensor for leaf in flatten(state).tensors]
        if len(tensors) != len(manifest.tensors):
            held, listed = len(tensors), len(manifest.tensors)
            raise CheckpointError(f"{source}: the structure holds {held} tensors, the table lists {listed}")
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
        out_dir = Path(args.out)
        out_dir.mkdir(parents=True, exist_ok=True)
        # The bar counts toward the raw size; compressed output ends short of it, and the bar then fills.
        with ReadProgress(f"write {manifest.step}", manifest.raw_bytes, counter="wchar"):
            result = persist_to(job, out_dir / checkpoint_name(manifest.step), encoder, storage)
    finally:
        encoder.close()
    print(
        f"wrote {result.path}: {len(tensors)} tensors, {result.raw_bytes} bytes raw, {result.stored_bytes} stored "
        f"({result.ratio:.3f}x; {', '.join(f'{k}: {v}' for k, v in sorted(result.codecs.items()))})"
    )
    return 0


def _read(source: Path, device: torch.device | str) -> tuple[Manifest, Any]:
    """The manifest and the state, every blob verified by :func:`asyncckpt.load`; a bar on a terminal."""
    manifest = read_manifest(source)
    with ReadProgress(f"read {source.name}", manifest.stored_bytes):
        return manifest, load(source, map_location=device)


def _encoder_for(codec: str) -> tuple[Encoder, Storage, torch.device]:
    """The encoder and storage for ``codec``: the CPU ones for zstd/none, the GPU pipeline otherwise."""
    if codec in CPU_CODECS:
        return cpu_encoder(CheckpointOptions(codec=codec)), PosixStorage(), torch.device("cpu")
    from .._gpu.deps import gpu_path_available, require_cuda

    if codec == "auto" and not gpu_path_available():
        return cpu_encoder(CheckpointOptions(codec="zstd")), PosixStorage(), torch.device("cpu")
    device = require_cuda(f"converting to codec {codec!r}")
    from .._gpu.pipeline import GpuEncoder
    from .._gpu.storage import KvikioStorage

    return GpuEncoder(codec, device), KvikioStorage(device), device


def _model_key(state: Any) -> str | None:
    if isinstance(state, dict):
        for key in MODEL_KEYS:
            if isinstance(state.get(key), dict):
                return key
    return None


def _entry(state: Any, key: str) -> Any:
    """The entry at dotted path ``key`` (dict keys; list/tuple indices as numbers)."""
    node = state
    for part in key.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif _has_index(node, part):
            node = node[int(part)]
        else:
            top = sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__
            raise CheckpointError(f"--key {key!r}: no entry {part!r} in the checkpoint's state (top level: {top})")
    return node


def _has_index(node: Any, part: str) -> bool:
    """Whether ``part`` is an int key of a dict (optimizer state) or an index of a list/tuple in ``node``."""
    if not part.lstrip("-").isdigit():
        return False
    if isinstance(node, dict):
        return int(part) in node
    return isinstance(node, (list, tuple)) and 0 <= int(part) < len(node)


def state_dict_tensors(state: Any) -> dict[str, torch.Tensor]:
    """Every tensor under ``state`` by its dotted path, as ``state_dict()`` names them; the rest is dropped.

    A tensor reachable under several keys (tied weights) is cloned for all but its first key:
    safetensors refuses shared memory, and ``load_state_dict`` wants every key.
    """
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, ...]] = set()

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, torch.Tensor):
            if prefix in out:
                raise CheckpointError(f"two entries of the state are both named {prefix!r} in a flat export")
            identity = (node.untyped_storage().data_ptr(), int(node.storage_offset()), *node.shape, -1, *node.stride())
            tied = identity in seen and node.numel() > 0
            seen.add(identity)
            out[prefix or "tensor"] = node.clone() if tied else node.contiguous()
        elif isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                walk(v, f"{prefix}.{i}" if prefix else str(i))

    walk(state, "")
    return out


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], manifest: Manifest, key: str | None) -> None:
    """Write ``tensors`` with the safetensors library; ``__metadata__`` keeps where they came from."""
    try:
        from safetensors.torch import save_file
    except ImportError as exc:
        raise CheckpointError(
            f"--to safetensors needs the safetensors package: pip install safetensors ({exc})"
        ) from exc
    metadata = {
        "format": "pt",
        "asyncckpt_step": str(manifest.step),
        "asyncckpt_metadata": json.dumps(manifest.metadata),
    }
    if key is not None:
        metadata["asyncckpt_key"] = key
    try:
        save_file(tensors, str(path), metadata=metadata)
    except (ValueError, TypeError, RuntimeError) as exc:  # a dtype or layout safetensors cannot store
        path.unlink(missing_ok=True)
        raise CheckpointError(f"safetensors cannot store this state ({exc}); try --to torch or --key") from exc


class _Decoded(StagedAtOnce):
    """A snapshot of decoded tensors (nothing to wait for; the caller owns the memory)."""

    staging_bytes = 0

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
