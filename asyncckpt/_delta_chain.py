"""Reading delta checkpoints: follow a record's chain of bases and undo each delta.

A format-4 manifest's ``reference`` names an earlier step of the same run directory and that
checkpoint's manifest digest; a record with ``delta`` set decodes to the transformed bytes, and
the tensor is :func:`~asyncckpt._delta_ops.decode_delta` of them against the record of the same
``file`` and ``key`` in that base (itself perhaps a delta against its own base). Per-rank data
files of a distributed checkpoint (``data-r{rank}.bin``) thus refer to the same rank's data.

Everything is checked as hostile input before it is used, each failure a
``CorruptCheckpointError`` that names the dependent record and the base step:

* the base is ``step-NNNNNNNNNN`` beside the checkpoint (a directory, not a symlink), with a
  manifest whose digest is the one recorded (a replaced or rewritten base is refused);
* its step is below the dependent's (checked when the manifest is parsed), so a chain cannot
  cycle, and a chain is at most :data:`MAX_CHAIN_DEPTH` checkpoints long;
* the base has exactly one record of that file and key, with the same dtype and raw size;
* the base's blobs pass every check a load makes (layout, checksums, sizes).

Only the bases a record needs are opened, and only the records needed are read: restoring a
tensor reads at most its chain depth checkpoints. Runs on the calling thread.
"""

from __future__ import annotations

import os
import stat
from contextlib import ExitStack
from pathlib import Path

import torch

from . import _checksum as checksum
from ._codecs import get_decoder
from ._delta_ops import decode_delta
from ._dtypes import dtype_from_name
from ._layout import checkpoint_name
from ._manifest import Manifest, TensorRecord, read_manifest
from ._read_layout import check_layout, tensor_where
from ._storage import BlobReader, PosixStorage
from .errors import CheckpointError, CorruptCheckpointError

__all__ = ["MAX_CHAIN_DEPTH", "ChainReader", "read_record_raw"]

MAX_CHAIN_DEPTH = 64
"""The most bases a reader follows from one checkpoint; a longer chain is refused as corrupt
(a writer's chain is at most ``delta_full_every`` <= 64 checkpoints long)."""


def read_record_raw(reader: BlobReader, record: TensorRecord, where: str) -> torch.Tensor:
    """Read ``record``'s blob, verify its checksum, decode it: its raw (stored-form) bytes, 1-D uint8.

    For a delta record these are the transformed bytes; :meth:`ChainReader.raw` undoes the delta.
    """
    blob = reader.read(record.offset, record.stored_bytes)
    algorithm = checksum.check_algorithm(record.checksum.algorithm, where)
    checksum.verify_value(algorithm, record.checksum.value, checksum.compute(algorithm, blob), where)
    decoder = get_decoder(record.codec, where)
    try:
        out = torch.empty(record.raw_bytes, dtype=torch.uint8)
    except RuntimeError as exc:
        raise CheckpointError(f"{where}: cannot allocate {record.raw_bytes} bytes to decode it: {exc}") from exc
    try:
        decoder.decode(blob, record.chunks, record.codec_params, out)
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(f"{where}: {exc}") from exc
    return out


class ChainReader:
    """One checkpoint of a chain: reads its records' tensor bytes, asking its base for deltas.

    Use as a context manager (it closes every data file it opened, its bases' too).
    """

    def __init__(self, checkpoint: Path, manifest: Manifest, depth: int = 0,
                 stack: ExitStack | None = None) -> None:  # fmt: skip
        self.checkpoint, self.manifest, self.depth = checkpoint, manifest, depth
        self._own_stack = stack is None
        self._stack = stack if stack is not None else ExitStack()
        self._files: dict[str, tuple[Path, int]] | None = None
        self._readers: dict[str, BlobReader] = {}
        self._base: ChainReader | None = None
        self._index: dict[tuple[str, str], TensorRecord] | None = None

    def __enter__(self) -> ChainReader:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._own_stack:
            self._stack.close()

    def raw(self, record: TensorRecord) -> torch.Tensor:
        """The tensor bytes of ``record`` (one of this checkpoint's), 1-D uint8 on the CPU."""
        where = tensor_where(self.checkpoint, record)
        if self._files is None:
            self._files = check_layout(self.checkpoint, self.manifest.tensors)
        if record.file not in self._readers:
            path = self._files[record.file][0]
            try:
                self._readers[record.file] = PosixStorage().open_reader(path)
            except OSError as exc:
                raise CorruptCheckpointError(f"{path}: cannot open the data file: {exc}") from exc
            self._stack.callback(self._readers[record.file].close)
        if record.delta is None:
            return read_record_raw(self._readers[record.file], record, where)
        # The base first: each level then holds its base's bytes and its own, never a whole chain's.
        reference = self.base_raw(record)
        out = read_record_raw(self._readers[record.file], record, where)
        return decode_delta(out, reference, record.delta, dtype_from_name(record.dtype, where))

    def base_raw(self, record: TensorRecord) -> torch.Tensor:
        """The bytes of ``record``'s counterpart in the base checkpoint, its own deltas undone."""
        try:
            return self.base().raw(self.base_record(record))
        except CorruptCheckpointError as exc:
            raise self.base_error(record, exc) from exc

    def base(self) -> ChainReader:
        """The base checkpoint, checked (beside this one, not a symlink, digest and step as recorded)."""
        if self.manifest.reference is None:
            raise CorruptCheckpointError(f"{self.checkpoint}: has delta records, but the manifest has no reference")
        return self._base_reader()

    def base_record(self, record: TensorRecord) -> TensorRecord:
        """The base's record of ``record``'s file and key, checked to have its dtype and raw size."""
        base = self.base()
        found = base.lookup(record)
        if found.dtype != record.dtype or found.raw_bytes != record.raw_bytes:
            raise CorruptCheckpointError(
                f"{tensor_where(base.checkpoint, found)}: is {found.dtype} of {found.raw_bytes} bytes, but the "
                f"delta against it is {record.dtype} of {record.raw_bytes} bytes"
            )
        return found

    def base_error(self, record: TensorRecord, exc: CorruptCheckpointError) -> CorruptCheckpointError:
        """``exc`` (about the base) as an error about the dependent ``record``, naming both."""
        reference = self.manifest.reference
        step = reference.step if reference is not None else "?"
        return CorruptCheckpointError(
            f"{tensor_where(self.checkpoint, record)}: is a delta against step {step}, and that base checkpoint is "
            f"missing or corrupt: {exc}"
        )

    def lookup(self, record: TensorRecord) -> TensorRecord:
        """This checkpoint's record of ``record``'s file and key (exactly one)."""
        if self._index is None:
            index: dict[tuple[str, str], TensorRecord] = {}
            for own in self.manifest.tensors:
                if (own.file, own.key) in index:
                    raise CorruptCheckpointError(
                        f"{tensor_where(self.checkpoint, own)}: two records of this key in one data file"
                    )
                index[own.file, own.key] = own
            self._index = index
        found = self._index.get((record.file, record.key))
        if found is None:
            raise CorruptCheckpointError(f"{self.checkpoint}: has no record of {record.key!r} in {record.file}")
        return found

    def _base_reader(self) -> ChainReader:
        if self._base is not None:
            return self._base
        reference = self.manifest.reference
        assert reference is not None
        if self.depth + 1 > MAX_CHAIN_DEPTH:
            raise CorruptCheckpointError(
                f"{self.checkpoint}: a chain of more than {MAX_CHAIN_DEPTH} delta checkpoints; refusing to follow it"
            )
        path = self.checkpoint.parent / checkpoint_name(reference.step)
        try:
            is_link = stat.S_ISLNK(os.lstat(path).st_mode)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{path}: the base checkpoint (step {reference.step}) is missing") from None
        if is_link:
            raise CorruptCheckpointError(f"{path}: the base checkpoint is a symlink; refusing to follow it")
        manifest = read_manifest(path)
        if manifest.digest != reference.manifest_sha256:
            raise CorruptCheckpointError(
                f"{path}: its manifest digest {manifest.digest} is not the {reference.manifest_sha256} "
                f"{self.checkpoint.name} was written against (the base was replaced or rewritten)"
            )
        if manifest.step != reference.step:
            raise CorruptCheckpointError(f"{path}: holds step {manifest.step}, not {reference.step}")
        self._base = ChainReader(path, manifest, self.depth + 1, self._stack)
        return self._base
