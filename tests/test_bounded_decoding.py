"""What a reader reads, allocates and decodes is bounded by the bytes the files hold, not by their claims.

Each case is a hostile checkpoint written by hand (resealed, as someone with write access could):
load() and verify() must both refuse it with CorruptCheckpointError, before doing the work it asks for.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import zstandard
from conftest import run_python

import asyncckpt
from asyncckpt._manifest import MANIFEST_NAME
from asyncckpt._manifest_digest import DIGEST_FIELD, seal, seal_text

Doc = dict[str, Any]


@pytest.fixture
def checkpoint(run_dir: Path) -> Path:
    state = {"w": torch.zeros(1024), "b": torch.arange(16, dtype=torch.int32)}
    with asyncckpt.AsyncCheckpointer(run_dir, codec="zstd") as ckpt:
        return ckpt.save(1, state).result().path  # type: ignore[return-value]


def _rewrite(checkpoint: Path, edit: Callable[[Doc], None]) -> None:
    path = checkpoint / MANIFEST_NAME
    doc = json.loads(path.read_bytes())
    del doc[DIGEST_FIELD]
    edit(doc)
    path.write_bytes(seal(doc))


def _append_blob(checkpoint: Path, blob: bytes) -> int:
    """Write ``blob`` at the next aligned offset of data-0.bin; returns that offset."""
    data = checkpoint / "data-0.bin"
    offset = (data.stat().st_size + 4095) // 4096 * 4096
    with open(data, "r+b") as f:
        f.seek(offset)
        f.write(blob)
    return offset


def _point(doc: Doc, key: str, **fields: Any) -> None:
    next(t for t in doc["tensors"] if t["key"] == key).update(fields)


def _refused_by_both(checkpoint: Path, message: str) -> None:
    for check in (asyncckpt.load, asyncckpt.verify):
        with pytest.raises(asyncckpt.CorruptCheckpointError, match=message):
            check(checkpoint)


def _zstd_record(blob: bytes, raw: int) -> dict[str, Any]:
    checksum = {"algorithm": "crc32", "value": f"{zlib.crc32(blob):08x}"}
    return {"offset": 0, "stored_bytes": len(blob), "chunks": [[len(blob), raw]], "codec": "zstd",
            "codec_params": {"planes": 1}, "checksum": checksum}  # fmt: skip


def test_a_frame_that_declares_more_than_its_record_is_refused_before_decoding(checkpoint: Path) -> None:
    # 1 GiB of zeros in a frame of about 32 KiB, recorded as the 4 KiB tensor "w" (1024 float32).
    compressor = zstandard.ZstdCompressor(level=1).compressobj(size=1 << 30)
    zeros = bytes(1 << 20)
    bomb = b"".join(compressor.compress(zeros) for _ in range(1024)) + compressor.flush()
    assert len(bomb) < 64 << 10
    offset = _append_blob(checkpoint, bomb)
    _rewrite(checkpoint, lambda d: _point(d, "w", **{**_zstd_record(bomb, 4096), "offset": offset}))
    _refused_by_both(checkpoint, r"'w'.*frame header declares 1073741824 bytes, the manifest 4096")
    # In a fresh process: what the refusal cost in memory (the frame would take 1 GiB to decode).
    code = f"""
import resource, asyncckpt
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for check in (asyncckpt.load, asyncckpt.verify):
    try:
        check({str(checkpoint)!r})
    except asyncckpt.CorruptCheckpointError:
        pass
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""
    grown_mib = int(run_python(code).stdout.split()[-1])
    assert grown_mib < 128, f"refusing the frame grew the process by {grown_mib} MiB"


def test_a_frame_header_claiming_a_terabyte_is_corrupt_not_memory_error(checkpoint: Path) -> None:
    # Magic, single-segment frame with an 8-byte content size of 1 TiB, then one empty last raw block.
    header = struct.pack("<IB", 0xFD2FB528, 0xE0) + struct.pack("<Q", 1 << 40) + b"\x01\x00\x00"
    offset = _append_blob(checkpoint, header)
    _rewrite(checkpoint, lambda d: _point(d, "w", **{**_zstd_record(header, 4096), "offset": offset}))
    _refused_by_both(checkpoint, r"'w'.*frame header declares 1099511627776 bytes")


def test_a_raw_size_no_codec_can_reach_is_refused_before_allocating(checkpoint: Path) -> None:
    # 2**40 float32 elements (4 TiB) claimed from the 9 bytes of one zstd frame: at most 288 KiB.
    def huge(doc: Doc) -> None:
        record = next(t for t in doc["tensors"] if t["key"] == "w")
        record.update(shape=[1 << 40], raw_bytes=4 << 40, chunks=[[record["stored_bytes"], 4 << 40]])

    _rewrite(checkpoint, huge)
    _refused_by_both(checkpoint, r"'w'.*chunk 0 claims 4398046511104 raw bytes from \d+ stored bytes")


@pytest.mark.parametrize(("codec", "ratio"), [("lz4", 300), ("deflate", 1100), ("none", 2)])
def test_every_cpu_codec_has_an_expansion_bound(checkpoint: Path, codec: str, ratio: int) -> None:
    def claim(doc: Doc) -> None:
        record = next(t for t in doc["tensors"] if t["key"] == "w")
        stored = record["stored_bytes"]
        raw = ratio * stored * 4 // 4 * 4 + 2048
        record.update(codec=codec, shape=[raw // 4], raw_bytes=raw, chunks=[[stored, raw]])

    _rewrite(checkpoint, claim)
    _refused_by_both(checkpoint, rf"'w'.*claims \d+ raw bytes from \d+ stored bytes, more than {codec} can")


def test_a_flood_of_empty_chunks_is_refused_while_parsing(checkpoint: Path) -> None:
    path = checkpoint / MANIFEST_NAME
    doc = json.loads(path.read_bytes())
    del doc[DIGEST_FIELD]
    record = next(t for t in doc["tensors"] if t["key"] == "w")
    record["chunks"] = record["chunks"] + [[0, 0]] * 2_000_000
    path.write_bytes(seal_text(json.dumps(doc).encode()))  # compact: json's indenting encoder is slow at this size
    assert (checkpoint / MANIFEST_NAME).stat().st_size > 10_000_000
    _refused_by_both(checkpoint, r"'w'.*2000001 chunks in \d+ stored bytes")


def test_records_sharing_one_blob_are_refused(checkpoint: Path) -> None:
    def alias(doc: Doc) -> None:
        w = next(t for t in doc["tensors"] if t["key"] == "w")
        doc["tensors"] = [{**w, "key": f"w{i}"} for i in range(256)]
        doc["structure"] = {"t": "list", "items": [{"t": "tensor", "id": i} for i in range(256)]}

    _rewrite(checkpoint, alias)
    _refused_by_both(checkpoint, r"'w1'.*overlaps the blob of 'w0'")


def test_partly_overlapping_blobs_are_refused(checkpoint: Path) -> None:
    def shift(doc: Doc) -> None:
        w, b = (next(t for t in doc["tensors"] if t["key"] == k) for k in ("w", "b"))
        b["offset"] = w["offset"] + 1 if w["stored_bytes"] > 1 else b["offset"]

    _rewrite(checkpoint, shift)
    _refused_by_both(checkpoint, r"overlaps the blob of")


@pytest.mark.parametrize("device", ["tpu:0", "meta", "cuda:x", "cpu:0 ", "", "cuda:-1"])
def test_verify_refuses_the_device_fields_load_refuses(checkpoint: Path, device: str) -> None:
    _rewrite(checkpoint, lambda d: _point(d, "w", device=device))
    _refused_by_both(checkpoint, r"invalid device")  # map_location does not make it acceptable either:
    with pytest.raises(asyncckpt.CorruptCheckpointError, match="invalid device"):
        asyncckpt.load(checkpoint, map_location="cpu")
