"""The manifest: one JSON document that describes a checkpoint (format v3/v4, docs/format.md).

Writing is JSON of the dataclasses (one tensor record per line), sealed with a SHA-256 of its own bytes
(:mod:`asyncckpt._manifest_digest`). Reading treats the file as hostile input: the digest is
checked before the JSON is parsed, then every field is type- and range-checked before anything
is allocated or opened, and every error is a :class:`CorruptCheckpointError` that names the
manifest and the offending field.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from ._delta_ops import DELTA_OPS
from ._dtypes import dtype_from_name
from ._files import read_regular_file
from ._manifest_digest import DIGEST_FIELD, seal, unseal
from .errors import CheckpointError, CorruptCheckpointError

FORMAT_NAME = "asyncckpt"
TENSOR_PLANES_VERSION = 2
"""Version 2 added ``planes_span: "tensor"`` (tensor-wide byte planes, GPU ``auto``): a version-1
reader ignores that parameter and would decode the bytes in the wrong order behind a passing
checksum, so it must refuse the file instead, and does (it reads only 1)."""
DIGEST_VERSION = 3
"""Version 3 added the manifest's own SHA-256 (:mod:`asyncckpt._manifest_digest`); every manifest
is written as version 3, and a version-3 manifest without a valid digest is corrupt."""
FORMAT_VERSION = DIGEST_VERSION
"""The version every manifest without deltas is written as."""
DELTA_VERSION = 4
"""Version 4 added incremental checkpoints: a top-level ``reference`` (the checkpoint this one's delta
records are relative to) and a per-record ``delta`` op. Only a manifest with at least one delta
record is written as version 4, so that a version-3 reader refuses it instead of loading the
transformed bytes as the tensor; every other manifest stays version 3, with the members it had before."""
READABLE_VERSIONS = (1, TENSOR_PLANES_VERSION, DIGEST_VERSION, DELTA_VERSION)
MANIFEST_NAME = "manifest.json"
MAX_MANIFEST_BYTES = 256 << 20
MAX_TENSOR_BYTES = 1 << 46
"""64 TiB: larger than any tensor a node can hold; anything bigger is a corrupt size."""
MAX_DIMS = 64

_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_DEVICE = re.compile(r"cpu|cuda(:[0-9]{1,5})?")
"""The devices a tensor is saved from, and so the only ones load() places a tensor on."""


@dataclass(frozen=True)
class Checksum:
    algorithm: str
    value: str


@dataclass(frozen=True)
class TensorRecord:
    """Where and how one tensor is stored."""

    key: str
    dtype: str
    shape: list[int]
    device: str
    file: str
    offset: int
    stored_bytes: int
    raw_bytes: int
    codec: str
    codec_params: dict[str, Any]
    chunks: list[tuple[int, int]]
    """``(stored, raw)`` bytes per chunk, written as ``[stored, raw]``. Tuples, not lists: a tuple of ints
    is untracked by the garbage collector the first time it looks, while a list stays tracked, and the
    31,000 chunk lists of a 2.8B-parameter state, alive from the write to the commit of every save, set
    off a full collection (all threads stopped, ~0.1 s) every few saves."""
    checksum: Checksum
    delta: str | None = None
    """Version 4: None (the blob decodes to the tensor's bytes) or a :data:`~asyncckpt._delta_ops.DELTA_OPS`
    name: the blob decodes to :func:`~asyncckpt._delta_ops.encode_delta` of the tensor's bytes against the
    record of the same ``file`` and ``key`` in the checkpoint named by the manifest's ``reference``."""


@dataclass(frozen=True)
class Reference:
    """Version 4: the checkpoint a delta checkpoint's delta records are relative to."""

    step: int
    manifest_sha256: str
    """That checkpoint's manifest digest when this one was written: a base replaced later is detected."""


@dataclass(frozen=True)
class Manifest:
    step: int
    created_unix: float
    library_version: str
    tensors: list[TensorRecord]
    structure: dict[str, Any]
    metadata: dict[str, Any] = field(default_factory=dict)
    io_mode: str = "posix"
    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION
    reference: Reference | None = None
    """Version 4: the base checkpoint of the delta records (None: no record is a delta)."""
    digest: str | None = field(default=None, compare=False)
    """The ``manifest_sha256`` it was read with (hex), None for a manifest of version 1 or 2, which
    has none; never written from here (:meth:`to_json` computes it)."""

    @property
    def raw_bytes(self) -> int:
        return sum(t.raw_bytes for t in self.tensors)

    @property
    def stored_bytes(self) -> int:
        return sum(t.stored_bytes for t in self.tensors)

    @property
    def is_delta(self) -> bool:
        """Whether any record is stored as a delta against :attr:`reference`."""
        return self.reference is not None and any(t.delta is not None for t in self.tensors)

    def to_json(self) -> bytes:
        """The manifest file's bytes, sealed with its digest: version 4 if any record is a delta, else 3.

        A version-3 manifest has neither ``reference`` nor any record's ``delta`` (its members are
        exactly what versions before deltas wrote).
        """
        if any(t.delta is not None for t in self.tensors) and self.reference is None:
            raise ValueError("a manifest with delta records needs a reference")
        doc = _fields_of(self)
        doc["tensors"] = [_fields_of(t) for t in self.tensors]
        del doc["digest"]
        if self.is_delta:
            doc["format_version"] = DELTA_VERSION
        else:
            doc["format_version"] = FORMAT_VERSION
            del doc["reference"]
            for record in doc["tensors"]:
                del record["delta"]
        return seal(doc)


def _fields_of(obj: Any) -> dict[str, Any]:
    """A dataclass's fields as a dict, those that are dataclasses converted too (a record's checksum,
    the reference), sharing its lists and dicts (which hold only JSON values).

    Not ``dataclasses.asdict``, which deep-copies every value: ~80 ms of pure Python for the
    31,000 chunk lists of a 2.8B-parameter state, on the worker thread at the end of every save,
    and as many new objects for the garbage collector. The document is only serialised, never changed
    below its top level."""
    return {f.name: _fields_of(v) if is_dataclass(v) else v for f in fields(obj) for v in (getattr(obj, f.name),)}


def manifest_json(manifest: Manifest, where: str | Path) -> bytes:
    """``manifest``'s file bytes, or CheckpointError if :func:`read_manifest` would refuse their size.

    Every writer of a manifest (a save, a distributed part and commit, the DCP plugin) goes
    through this (:func:`asyncckpt._commit.commit_checkpoint`, a distributed part). Any thread.
    """
    data = manifest.to_json()
    if len(data) > MAX_MANIFEST_BYTES:
        raise CheckpointError(
            f"{where}: the manifest would take {len(data)} bytes, more than the {MAX_MANIFEST_BYTES} load() "
            "accepts; not committed. Store fewer, larger tensors, or large str/bytes values as uint8 tensors"
        )
    return data


def read_manifest(checkpoint_dir: Path) -> Manifest:
    """Read and validate ``checkpoint_dir/manifest.json``."""
    path = checkpoint_dir / MANIFEST_NAME
    try:
        data = read_regular_file(path, MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        raise CorruptCheckpointError(
            f"{checkpoint_dir}: no {MANIFEST_NAME}; not a committed asyncckpt checkpoint"
        ) from None
    except OSError as exc:
        raise CorruptCheckpointError(f"{path}: cannot read manifest: {exc}") from exc
    if len(data) > MAX_MANIFEST_BYTES:
        raise CorruptCheckpointError(f"{path}: manifest larger than {MAX_MANIFEST_BYTES} bytes")
    return parse_manifest(data, str(path))


def parse_manifest(data: bytes, where: str) -> Manifest:
    """Check the digest of a manifest file's bytes, then parse and validate it. Any thread."""
    digest = unseal(data, where)  # before any field is trusted, or the JSON even parsed
    try:
        doc = json.loads(data, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{where}: not valid JSON: {exc}") from exc
    fields = _Fields(doc, where)
    fmt = fields.get("format", str)
    if fmt != FORMAT_NAME:
        raise CorruptCheckpointError(f"{where}: format is {fmt!r}, not an asyncckpt manifest")
    version = fields.get("format_version", int)
    if version not in READABLE_VERSIONS:
        raise CorruptCheckpointError(
            f"{where}: format version {version} is not supported by this asyncckpt (reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}); upgrade asyncckpt to read it"
        )
    if version >= DIGEST_VERSION and (digest is None or doc.get(DIGEST_FIELD) != digest):
        # A damaged seal must not pass for an older, unsealed manifest.
        raise CorruptCheckpointError(
            f"{where}: a format version {version} manifest must begin with its {DIGEST_FIELD}; the manifest is corrupt"
        )
    if version < DIGEST_VERSION and (digest is not None or DIGEST_FIELD in doc):
        raise CorruptCheckpointError(
            f"{where}: a format version {version} manifest has no {DIGEST_FIELD}; the manifest is corrupt"
        )
    raw_tensors = fields.get("tensors", list)
    deltas = version >= DELTA_VERSION
    tensors = [_parse_tensor(item, f"{where}: tensors[{i}]", deltas) for i, item in enumerate(raw_tensors)]
    step = fields.nonnegative("step")
    reference = _reference(fields, step) if deltas else None
    if reference is None and any(t.delta is not None for t in tensors):
        raise CorruptCheckpointError(f"{where}: delta records but no reference checkpoint")
    return Manifest(
        step=step,
        created_unix=_finite_seconds(fields.get("created_unix", (int, float)), where),
        library_version=fields.get("library_version", str),
        tensors=tensors,
        structure=fields.get("structure", dict),
        metadata=fields.get("metadata", dict),
        io_mode=fields.get("io_mode", str),
        format_version=version,
        reference=reference,
        digest=digest,
    )


def _reference(fields: _Fields, step: int) -> Reference | None:
    """A version-4 manifest's ``reference``: null, or an earlier step and a manifest digest."""
    raw = fields.get("reference", (dict, type(None)))
    if raw is None:
        return None
    ref = _Fields(raw, f"{fields.where}: reference")
    base = ref.nonnegative("step")
    if base >= step:
        raise CorruptCheckpointError(f"{fields.where}: reference step {base} is not below the checkpoint's own "
                                     f"step {step}; the manifest is corrupt")  # fmt: skip
    digest = ref.get("manifest_sha256", str)
    if not _SHA256.fullmatch(digest):
        raise CorruptCheckpointError(f"{fields.where}: reference manifest_sha256 is not 64 lowercase hex digits")
    return Reference(step=base, manifest_sha256=digest)


def _finite_seconds(value: float, where: str) -> float:
    try:
        seconds = float(value)  # a JSON integer may be too large for a float
    except OverflowError:
        seconds = math.inf
    if not math.isfinite(seconds):
        raise CorruptCheckpointError(f"{where}: field 'created_unix' = {value!r:.40} is not a finite time")
    return seconds


def _reject_constant(name: str) -> None:
    raise ValueError(f"non-standard JSON constant {name}")


class _Fields:
    """Typed access to a JSON object's fields with errors that say where."""

    def __init__(self, doc: object, where: str) -> None:
        if not isinstance(doc, dict):
            raise CorruptCheckpointError(f"{where}: expected a JSON object, got {type(doc).__name__}")
        self.doc, self.where = doc, where

    def get(self, name: str, kind: type | tuple[type, ...]) -> Any:
        if name not in self.doc:
            raise CorruptCheckpointError(f"{self.where}: missing field {name!r}")
        value = self.doc[name]
        # bool is an int subclass; a size of `true` is a corrupt manifest, not 1.
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            raise CorruptCheckpointError(f"{self.where}: field {name!r} has type {type(value).__name__}")
        return value

    def nonnegative(self, name: str, limit: int = 1 << 62) -> int:
        value: int = self.get(name, int)
        if not 0 <= value <= limit:
            raise CorruptCheckpointError(f"{self.where}: field {name!r} = {value} is out of range [0, {limit}]")
        return value


def _parse_tensor(item: object, where: str, deltas: bool = False) -> TensorRecord:
    f = _Fields(item, where)
    key = f.get("key", str)
    where = f"{where} ({key!r})"
    f.where = where
    dtype = dtype_from_name(f.get("dtype", str), where)
    shape = f.get("shape", list)
    if len(shape) > MAX_DIMS or not all(type(d) is int and 0 <= d <= MAX_TENSOR_BYTES for d in shape):
        raise CorruptCheckpointError(f"{where}: invalid shape {shape!r}")
    raw_bytes = f.nonnegative("raw_bytes", MAX_TENSOR_BYTES)
    expected = math.prod(shape) * dtype.itemsize
    if raw_bytes != expected:
        raise CorruptCheckpointError(f"{where}: raw_bytes {raw_bytes} does not match shape {shape} of {dtype}")
    file_name = f.get("file", str)
    if not _FILE_NAME.fullmatch(file_name) or file_name == MANIFEST_NAME:
        raise CorruptCheckpointError(f"{where}: data file name {file_name!r} is not a plain file inside the checkpoint")
    stored_bytes = f.nonnegative("stored_bytes", MAX_TENSOR_BYTES)
    chunks = f.get("chunks", list)
    if len(chunks) > max(1, stored_bytes):
        # Every chunk takes at least one stored byte (an empty tensor stored raw: one chunk of none), so
        # a table of millions of empty chunks is refused here, at a cost bounded by the data file's size.
        raise CorruptCheckpointError(f"{where}: {len(chunks)} chunks in {stored_bytes} stored bytes")
    if not all(isinstance(c, list) and len(c) == 2 and all(type(n) is int and n >= 0 for n in c) for c in chunks):
        raise CorruptCheckpointError(f"{where}: chunks must be [stored_bytes, raw_bytes] pairs of non-negative ints")
    if sum(c[0] for c in chunks) != stored_bytes or sum(c[1] for c in chunks) != raw_bytes:
        raise CorruptCheckpointError(f"{where}: chunk sizes do not add up to stored_bytes/raw_bytes")
    checksum = _Fields(f.get("checksum", dict), f"{where}: checksum")
    delta = f.get("delta", (str, type(None))) if deltas else None
    if delta is not None and delta not in DELTA_OPS:
        raise CorruptCheckpointError(f"{where}: unknown delta op {delta!r} (known: {', '.join(DELTA_OPS)})")
    return TensorRecord(
        key=key,
        dtype=f.get("dtype", str),
        shape=shape,
        device=_device(f.get("device", str), where),
        file=file_name,
        offset=f.nonnegative("offset"),
        stored_bytes=stored_bytes,
        raw_bytes=raw_bytes,
        codec=f.get("codec", str),
        codec_params=f.get("codec_params", dict),
        chunks=[(c[0], c[1]) for c in chunks],
        checksum=Checksum(algorithm=checksum.get("algorithm", str), value=checksum.get("value", str)),
        delta=delta,
    )


def _device(name: str, where: str) -> str:
    if not _DEVICE.fullmatch(name):
        raise CorruptCheckpointError(f"{where}: invalid device {name!r} (a tensor is saved from 'cpu' or 'cuda:N')")
    return name
