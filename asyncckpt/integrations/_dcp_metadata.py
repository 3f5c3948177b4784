"""DCP's checkpoint metadata as JSON, instead of the pickle file ``FileSystemWriter`` writes.

``torch.distributed.checkpoint`` stores its :class:`~torch.distributed.checkpoint.metadata.Metadata`
(what tensors exist, their global sizes and chunks; the planner's key mappings) as a pickle in
``.metadata``, so loading an untrusted checkpoint with ``FileSystemReader`` can run code. The
asyncckpt plugin writes the same information as plain JSON inside the checkpoint's format-v1
``manifest.json`` (under ``metadata["dcp"]``) and rebuilds the dataclasses from it here, checking
every field: a malformed document is a :class:`~asyncckpt.CorruptCheckpointError`, never code.

Layout of ``metadata["dcp"]``::

    {"version": "1.0.0",
     "state_dict": {fqn: {"kind": "bytes"}
                       | {"kind": "tensor", "dtype": "float32", "size": [...], "requires_grad": false,
                          "memory_format": "contiguous", "pin_memory": false,
                          "chunks": [{"offsets": [...], "sizes": [...]}, ...]}},
     "planner_data": <asyncckpt typed-JSON node (_tree.py)>,
     "storage_meta": {"checkpoint_id": str | null, "save_id": str | null, "modules": [str]},
     "items": [[fqn, offsets | null, kind, tensor_index], ...]}

``items`` maps each stored chunk (DCP's ``MetadataIndex``) to its record in the manifest's tensor
table, where the usual asyncckpt record (file, offset, codec, checksum) says how to read it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from .._dtypes import dtype_from_name, dtype_name
from .._manifest import MAX_DIMS, MAX_TENSOR_BYTES
from .._tree import flatten, unflatten
from ..errors import CheckpointError, CorruptCheckpointError

DCP_KEY = "dcp"

_MEMORY_FORMATS = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last,
                   "preserve": torch.preserve_format}  # fmt: skip
_FORMAT_NAMES = {v: k for k, v in _MEMORY_FORMATS.items()}


def encode_metadata(metadata: Metadata, items: list[tuple[MetadataIndex, str, int]]) -> dict[str, Any]:
    """JSON form of ``metadata`` plus the ``(index, kind, tensor_index)`` of every stored chunk."""
    state: dict[str, Any] = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, BytesStorageMetadata):
            state[fqn] = {"kind": "bytes"}
            continue
        props = entry.properties
        name = dtype_name(props.dtype)
        if name is None or props.layout != torch.strided or props.memory_format not in _FORMAT_NAMES:
            raise CheckpointError(f"DCP entry {fqn!r}: cannot store a {props.dtype} {props.layout} tensor")
        state[fqn] = {
            "kind": "tensor", "dtype": name, "size": list(entry.size), "requires_grad": bool(props.requires_grad),
            "memory_format": _FORMAT_NAMES[props.memory_format], "pin_memory": bool(props.pin_memory),
            "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in entry.chunks],
        }  # fmt: skip
    try:
        planner = flatten(metadata.planner_data)
    except TypeError as exc:
        raise CheckpointError(f"the DCP planner's planner_data cannot be stored as JSON: {exc}") from exc
    if planner.tensors:
        raise CheckpointError("the DCP planner's planner_data holds tensors; asyncckpt stores it as JSON only")
    meta = metadata.storage_meta
    return {
        "version": metadata.version,
        "state_dict": state,
        "planner_data": planner.skeleton,
        "storage_meta": None if meta is None else {
            "checkpoint_id": None if meta.checkpoint_id is None else str(meta.checkpoint_id),
            "save_id": meta.save_id, "modules": list(meta.modules),
        },
        "items": [[i.fqn, None if i.offset is None else list(i.offset), kind, t] for i, kind, t in items],
    }  # fmt: skip


def decode_metadata(
    doc: object, tensor_count: int, where: str
) -> tuple[Metadata, list[tuple[MetadataIndex, str, int]]]:
    """Rebuild DCP's ``Metadata`` and the chunk index from :func:`encode_metadata`'s JSON (hostile input)."""

    def bad(message: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where}: DCP metadata: {message}")

    if not isinstance(doc, dict):
        raise bad("missing or not an object; not a checkpoint written by asyncckpt's DCP writer")
    state_doc = doc.get("state_dict")
    if not isinstance(state_doc, dict):
        raise bad("state_dict is not an object")
    state: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    for fqn, entry in state_doc.items():
        if not isinstance(entry, dict) or entry.get("kind") not in ("bytes", "tensor"):
            raise bad(f"entry {fqn!r} is malformed")
        if entry["kind"] == "bytes":
            state[fqn] = BytesStorageMetadata()
            continue
        size = _dims(entry.get("size"), bad, fqn)
        chunks = entry.get("chunks")
        if not isinstance(chunks, list) or len(chunks) > 1 << 20:
            raise bad(f"entry {fqn!r} has no chunk list")
        memory_format = entry.get("memory_format")
        if memory_format not in _MEMORY_FORMATS or not isinstance(entry.get("requires_grad"), bool):
            raise bad(f"entry {fqn!r} has malformed properties")
        props = TensorProperties(dtype=dtype_from_name(entry.get("dtype"), f"{where}: {fqn!r}"),
                                 requires_grad=entry["requires_grad"], memory_format=_MEMORY_FORMATS[memory_format],
                                 pin_memory=bool(entry.get("pin_memory")))  # fmt: skip
        state[fqn] = TensorStorageMetadata(properties=props, size=torch.Size(size), chunks=[
            ChunkStorageMetadata(offsets=torch.Size(_dims(c.get("offsets") if isinstance(c, dict) else None, bad, fqn)),
                                 sizes=torch.Size(_dims(c.get("sizes") if isinstance(c, dict) else None, bad, fqn)))
            for c in chunks
        ])  # fmt: skip
    planner_data = unflatten(doc.get("planner_data"), _no_tensors(where), f"{where}: DCP planner_data")
    meta_doc = doc.get("storage_meta")
    storage_meta = StorageMeta()
    if isinstance(meta_doc, dict):
        modules = meta_doc.get("modules", [])
        storage_meta = StorageMeta(checkpoint_id=_opt_str(meta_doc.get("checkpoint_id"), bad),
                                   save_id=_opt_str(meta_doc.get("save_id"), bad),
                                   modules=[m for m in modules if isinstance(m, str)] if isinstance(modules, list)
                                   else [])  # fmt: skip
    items = []
    raw_items = doc.get("items")
    if not isinstance(raw_items, list):
        raise bad("items is not a list")
    for item in raw_items:
        well_formed = isinstance(item, list) and len(item) == 4 and isinstance(item[0], str)
        if not (
            well_formed and item[2] in ("tensor", "bytes") and type(item[3]) is int and 0 <= item[3] < tensor_count
        ):
            raise bad(f"malformed item {item!r:.200}")
        offset = None if item[1] is None else _dims(item[1], bad, item[0])
        items.append((MetadataIndex(item[0], offset), item[2], item[3]))
    version = doc.get("version")
    metadata = Metadata(state_dict_metadata=state, planner_data=planner_data, storage_meta=storage_meta,
                        version=version if isinstance(version, str) else None)  # fmt: skip
    return metadata, items


def _dims(value: object, bad: Any, fqn: str) -> list[int]:
    if (
        not isinstance(value, list)
        or len(value) > MAX_DIMS
        or not all(type(d) is int and 0 <= d <= MAX_TENSOR_BYTES for d in value)
    ):
        raise bad(f"entry {fqn!r} has an invalid size or offset {value!r:.100}")
    return value


def _opt_str(value: object, bad: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise bad("storage_meta field is not a string")
    return value


def _no_tensors(where: str) -> Any:
    def tensor_at(index: int) -> torch.Tensor:
        raise CorruptCheckpointError(f"{where}: DCP planner_data refers to a tensor")

    return tensor_at
