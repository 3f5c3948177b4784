"""Hypothesis strategies for random training states, a bit-exact comparison, and the test profiles.

Shared by ``tests/test_property_roundtrip.py`` (CPU codecs) and ``tests/gpu/test_gpu_property.py``.
Profiles: ``ci`` (the default: a few dozen examples, no example database) and ``nightly``
(thousands), chosen with ``HYPOTHESIS_PROFILE=nightly``.
"""

from __future__ import annotations

import math
import os
import struct
import zlib
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from asyncckpt._dtypes import DTYPE_BY_NAME, FLOATING_NAMES, dtype_name
from asyncckpt._manifest import MANIFEST_NAME, read_manifest
from asyncckpt._manifest_digest import DIGEST_FIELD, seal
from asyncckpt.testing.state_compare import first_difference

_SLOW = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture]
settings.register_profile("ci", max_examples=30, deadline=None, database=None, suppress_health_check=_SLOW,
                          print_blob=True)  # fmt: skip
settings.register_profile("nightly", max_examples=2000, deadline=None, suppress_health_check=_SLOW, print_blob=True)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
settings.load_profile(PROFILE)

DTYPES = list(DTYPE_BY_NAME.values())


@st.composite
def base_tensors(draw: st.DrawFn, device: str = "cpu") -> torch.Tensor:
    """A tensor of any storable dtype and a small shape (0-d and empty included), any bit pattern."""
    dtype = draw(st.sampled_from(DTYPES))
    if draw(st.booleans()):
        shape = draw(st.lists(st.integers(0, 5), max_size=3))
        size = math.prod(shape) * dtype.itemsize
        data = draw(st.binary(min_size=size, max_size=size))
    else:  # larger and compressible, so that zstd keeps its encoding rather than storing it raw
        shape = [draw(st.integers(1, 40)), draw(st.integers(1, 64))]
        size = math.prod(shape) * dtype.itemsize
        pattern = draw(st.binary(min_size=1, max_size=16))
        data = (pattern * (size // len(pattern) + 1))[:size]
    if dtype is torch.bool:
        data = bytes(b & 1 for b in data)  # a bool byte other than 0 or 1 is not a bool
    if not size:
        return torch.empty(shape, dtype=dtype, device=device)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape).to(device)


def _views() -> list[Callable[[torch.Tensor], torch.Tensor]]:
    """Ways to put a tensor into a state: itself (tied, when used twice) or a view of its memory."""
    return [
        lambda t: t,
        lambda t: t.t() if t.dim() == 2 else t,  # non-contiguous
        lambda t: t[::2] if t.dim() else t,  # strided
        lambda t: t[1:] if t.dim() else t,  # at an offset into the storage
        lambda t: t[0] if t.dim() and t.shape[0] else t,  # one dimension less (0-d from 1-d)
        lambda t: t.unsqueeze(0).expand(2, *t.shape),  # stride 0
        lambda t: t.reshape(-1) if t.is_contiguous() else t,
    ]


VIEWS = _views()


def float_from_bits(bits: int) -> float:
    value: float = struct.unpack("<d", struct.pack("<Q", bits))[0]
    return value


def float_bits(value: float) -> int:
    bits: int = struct.unpack("<Q", struct.pack("<d", value))[0]
    return bits


def scalars() -> st.SearchStrategy[Any]:
    """The scalar types the README lists, with every float bit pattern (NaN payloads included)."""
    return st.one_of(
        st.integers(-(1 << 200), 1 << 200),
        st.floats(),
        st.integers(0, (1 << 64) - 1).map(float_from_bits),
        st.text(max_size=12),
        st.booleans(),
        st.none(),
        st.binary(max_size=12),
        st.sampled_from(DTYPES),
        st.sampled_from([torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda")]),
    )


@st.composite
def states(draw: st.DrawFn, device: str = "cpu", max_leaves: int = 16) -> dict[Any, Any]:
    """A nested state: dict/OrderedDict/list/tuple/torch.Size of tensors (tied, viewed, empty, 0-d) and scalars."""
    pool = draw(st.lists(base_tensors(device), min_size=1, max_size=4))
    tensors = st.tuples(st.integers(0, len(pool) - 1), st.integers(0, len(VIEWS) - 1)).map(
        lambda iv: VIEWS[iv[1]](pool[iv[0]])
    )
    leaves = st.one_of(tensors, tensors, scalars())
    keys = st.one_of(st.text(max_size=6), st.integers(-3, 1 << 70))

    def containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        return st.one_of(
            st.lists(children, max_size=4),
            st.lists(children, max_size=4).map(tuple),
            st.dictionaries(keys, children, max_size=4),
            st.dictionaries(keys, children, max_size=4).map(OrderedDict),
            st.lists(st.integers(0, 9), max_size=3).map(torch.Size),
        )

    body = draw(st.recursive(leaves, containers, max_leaves=max_leaves))
    return {"state": body, "also": draw(st.lists(leaves, max_size=3))}


def leaves_of(state: Any) -> list[Any]:
    """Every leaf in walk order (dict values in key order)."""
    if isinstance(state, dict):
        return [leaf for value in state.values() for leaf in leaves_of(value)]
    if isinstance(state, (list, tuple)) and not isinstance(state, torch.Size):
        return [leaf for value in state for leaf in leaves_of(value)]
    return [state]


def difference(expected: Any, actual: Any) -> str | None:
    """None if ``actual`` equals ``expected`` bit for bit (types, key types and order, float bits, tensor bytes)."""
    return first_difference(expected, actual)


def tied_difference(expected: Any, actual: Any) -> str | None:
    """None if every tensor object that occurs twice in ``expected`` is one object in ``actual`` too.

    Empty tensors excepted: they have no memory to share, and asyncckpt stores each occurrence
    as its own leaf (``asyncckpt/_walker.py``), so they come back as equal, separate tensors.
    """
    before, after = leaves_of(expected), leaves_of(actual)
    first: dict[int, int] = {}
    for i, leaf in enumerate(before):
        if isinstance(leaf, torch.Tensor) and leaf.numel():
            j = first.setdefault(id(leaf), i)
            if after[j] is not after[i]:
                return f"leaves {j} and {i} were one tensor and came back as two"
    return None


def transcode(source: Path, target: Path, codec: str) -> None:
    """Rewrite the ``none``-coded checkpoint ``source`` into ``target`` with every blob in ``codec``.

    ``lz4`` (LZ4 block format) and ``deflate`` (raw DEFLATE) chunks, on byte planes for floating
    dtypes, as the GPU path writes them: what a CPU-only reader of a GPU checkpoint decodes.
    """
    import lz4.block

    manifest = read_manifest(source)
    doc: dict[str, Any] = {"tensors": []}
    out = bytearray()
    for record in manifest.tensors:
        assert record.codec == "none"
        with open(source / record.file, "rb") as f:
            f.seek(record.offset)
            raw = f.read(record.stored_bytes)
        itemsize = DTYPE_BY_NAME[record.dtype].itemsize
        planes = itemsize if record.dtype in FLOATING_NAMES and itemsize > 1 else 1
        step = 96 * planes
        chunks, blob = [], bytearray()
        for start in range(0, len(raw), step):
            piece = raw[start : start + step]
            planar = b"".join(piece[p::planes] for p in range(planes))  # byte-plane split
            if codec == "lz4":
                packed = lz4.block.compress(planar, store_size=False)
            else:
                deflater = zlib.compressobj(wbits=-15)
                packed = deflater.compress(planar) + deflater.flush()
            chunks.append([len(packed), len(piece)])
            blob += packed
        if not chunks:
            chunks = [[0, 0]]  # an empty tensor: one empty chunk, as the none codec writes it
            codec_of = "none"
        else:
            codec_of = codec
        offset = (len(out) + 4095) // 4096 * 4096
        out += bytes(offset - len(out)) + blob
        doc["tensors"].append({**_record_doc(record), "file": "data-0.bin", "offset": offset,
                               "stored_bytes": len(blob), "codec": codec_of, "chunks": chunks,
                               "codec_params": {"planes": planes} if codec_of != "none" else {},
                               "checksum": {"algorithm": "crc32", "value": f"{zlib.crc32(blob):08x}"}})  # fmt: skip
    target.mkdir()
    (target / "data-0.bin").write_bytes(bytes(out))
    original = (source / MANIFEST_NAME).read_bytes()
    import json

    full = json.loads(original)
    del full[DIGEST_FIELD]
    full["tensors"] = doc["tensors"]
    (target / MANIFEST_NAME).write_bytes(seal(full))


def _record_doc(record: Any) -> dict[str, Any]:
    from dataclasses import asdict

    fields: dict[str, Any] = asdict(record)
    return fields


__all__ = ["base_tensors", "difference", "dtype_name", "states", "tied_difference", "transcode"]
