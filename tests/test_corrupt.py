"""Corrupt files and hostile manifests: a clear error naming what and where, never a crash or a read outside."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncckpt
from asyncckpt._manifest import MANIFEST_NAME
from asyncckpt._manifest_digest import DIGEST_FIELD, seal, seal_text


@pytest.fixture
def checkpoint(run_dir: Path) -> Path:
    state = {"model": {"weight": torch.linspace(-1, 1, 4096), "bias": torch.arange(16)}, "step": 1}
    with asyncckpt.AsyncCheckpointer(run_dir) as ckpt:
        return ckpt.save(1, state).result().path  # type: ignore[return-value]


def _edit_manifest(checkpoint: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    path = checkpoint / MANIFEST_NAME
    doc = json.loads(path.read_text())
    del doc[DIGEST_FIELD]
    edit(doc)
    path.write_bytes(seal(doc))  # a consistent rewrite: the hostile fields themselves must be refused


def test_flipped_byte_names_tensor_and_file(checkpoint: Path) -> None:
    doc = json.loads((checkpoint / MANIFEST_NAME).read_text())
    record = next(t for t in doc["tensors"] if t["key"] == "model/bias")
    with open(checkpoint / record["file"], "r+b") as f:
        f.seek(record["offset"] + record["stored_bytes"] // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    for check in (lambda: asyncckpt.load(checkpoint), lambda: asyncckpt.verify(checkpoint)):
        with pytest.raises(asyncckpt.CorruptCheckpointError, match=r"'model/bias' in data-0\.bin: checksum mismatch"):
            check()


def test_truncated_data_file(checkpoint: Path) -> None:
    data = checkpoint / "data-0.bin"
    os.truncate(data, data.stat().st_size - 10)
    with pytest.raises(asyncckpt.CorruptCheckpointError, match="truncated"):
        asyncckpt.load(checkpoint)


def _tensor0(field: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        doc["tensors"][0][field] = value

    return edit


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_tensor0("file", "../../etc/passwd"), "not a plain file inside the checkpoint"),
        (_tensor0("file", "/etc/passwd"), "not a plain file inside the checkpoint"),
        (_tensor0("file", "manifest.json"), "not a plain file inside the checkpoint"),
        (_tensor0("offset", -4096), "'offset' = -4096 is out of range"),
        (_tensor0("stored_bytes", 1 << 60), "out of range"),
        (_tensor0("offset", True), "'offset' has type bool"),
        (_tensor0("shape", [1 << 40, 1 << 40]), "invalid shape|does not match shape"),
        (_tensor0("raw_bytes", 12), "does not match shape"),
        (_tensor0("dtype", "float128"), "unknown dtype 'float128'"),
        (_tensor0("codec", "lzma-extreme"), "unknown codec 'lzma-extreme'"),
        (_tensor0("codec", "ans"), "needs a CUDA GPU with the GPU extra"),
        (_tensor0("chunks", [[1, 2]]), "chunk sizes do not add up"),
        (_tensor0("checksum", {"algorithm": "md5", "value": "0"}), "unknown checksum algorithm 'md5'"),
        (lambda d: d.update(format_version=5), "format version 5 is not supported"),
        (lambda d: d.update(format="safetensors"), "not an asyncckpt manifest"),
        (lambda d: d.pop("tensors"), "missing field 'tensors'"),
        (lambda d: d.update(structure={"t": "tensor", "id": 99}), "structure refers to tensor 99"),
        (lambda d: d.update(structure={"t": "eval", "v": "__import__('os')"}), "unknown node type 'eval'"),
        (lambda d: d.update(structure={"t": "float", "v": 1.5}), "float node holds a float"),
        (lambda d: d.update(created_unix=10**400), "'created_unix' .* is not a finite time"),
        (
            lambda d: d.update(
                structure={
                    "t": "dict",
                    "items": [[{"t": "tuple", "items": [{"t": "list", "items": []}]}, {"t": "none"}]],
                }
            ),
            "unhashable dict key",
        ),
    ],
)
def test_hostile_manifest_fields(checkpoint: Path, edit: Callable[[dict[str, Any]], None], message: str) -> None:
    _edit_manifest(checkpoint, edit)
    with pytest.raises(asyncckpt.CheckpointError, match=message):
        asyncckpt.load(checkpoint)


def test_zstd_bomb_is_bounded_by_the_recorded_size(checkpoint: Path) -> None:
    # A blob that decompresses to far more than its chunk claims: decoding stops at the recorded size.
    import zlib

    import zstandard

    bomb = zstandard.ZstdCompressor().compress(bytes(64 << 20))
    data = checkpoint / "data-0.bin"
    offset = data.stat().st_size + 4096
    with open(data, "r+b") as f:
        f.seek(offset)
        f.write(bomb)

    def point_at_bomb(doc: dict[str, Any]) -> None:
        record = next(t for t in doc["tensors"] if t["key"] == "model/bias")
        record.update(
            offset=offset,
            stored_bytes=len(bomb),
            chunks=[[len(bomb), 128]],
            codec="zstd",
            codec_params={"planes": 1},
            checksum={"algorithm": "crc32", "value": f"{zlib.crc32(bomb):08x}"},
        )

    _edit_manifest(checkpoint, point_at_bomb)
    with pytest.raises(asyncckpt.CorruptCheckpointError, match="'model/bias'.*zstd"):
        asyncckpt.load(checkpoint)


@pytest.mark.parametrize(
    "content",
    [b"", b"{", b"[]", b"\xff\xfe", b"{" * 100_000, b'{"format": NaN}', b"1" * 5000],
)
def test_garbage_manifest(checkpoint: Path, content: bytes) -> None:
    (checkpoint / MANIFEST_NAME).write_bytes(content)
    with pytest.raises(asyncckpt.CorruptCheckpointError):
        asyncckpt.load(checkpoint)


@pytest.mark.parametrize("depth", [100, 50_000])
def test_deeply_nested_structure(checkpoint: Path, depth: int) -> None:
    path = checkpoint / MANIFEST_NAME
    nested = '{"t": "list", "items": [' * depth + '{"t": "none"}' + "]}" * depth
    doc = json.loads(path.read_text())
    doc.pop("structure")
    del doc[DIGEST_FIELD]
    path.write_bytes(seal_text((json.dumps(doc)[:-1] + ', "structure": ' + nested + "}").encode()))
    with pytest.raises(asyncckpt.CorruptCheckpointError, match="nested deeper|nesting too deep|not valid JSON"):
        asyncckpt.load(checkpoint)


def test_symlinked_data_file_is_refused(checkpoint: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside.bin"
    (checkpoint / "data-0.bin").rename(outside)
    (checkpoint / "data-0.bin").symlink_to(outside)
    with pytest.raises(asyncckpt.CorruptCheckpointError, match="not a regular file"):
        asyncckpt.load(checkpoint)


def test_missing_data_file(checkpoint: Path) -> None:
    (checkpoint / "data-0.bin").unlink()
    with pytest.raises(asyncckpt.CorruptCheckpointError, match="'data-0.bin' named in the manifest is missing"):
        asyncckpt.verify(checkpoint)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_cuda_tensors_on_a_cpu_only_machine_need_map_location(checkpoint: Path) -> None:
    _edit_manifest(checkpoint, _tensor0("device", "cuda:0"))
    with pytest.raises(asyncckpt.CheckpointError, match="CUDA is not available here; pass map_location='cpu'"):
        asyncckpt.load(checkpoint)
    assert asyncckpt.load(checkpoint, map_location="cpu")["step"] == 1
    _edit_manifest(checkpoint, _tensor0("device", "tpu:0"))
    with pytest.raises(asyncckpt.CheckpointError, match="cannot place a tensor on tpu:0|invalid device"):
        asyncckpt.load(checkpoint)


def test_every_manifest_is_written_as_version_3_and_versions_1_and_2_are_still_read(tmp_path: Path) -> None:
    # Version 2 made a version-1 reader refuse tensor-wide planes (it would join them in the wrong
    # order behind a passing checksum); version 3 (the manifest digest) is written for every
    # manifest, planes_span included, and a reader of 1 and 2 refuses it.
    from asyncckpt._manifest import TensorRecord, parse_manifest

    with asyncckpt.AsyncCheckpointer(tmp_path / "run") as ckpt:
        path = ckpt.save(1, {"w": torch.arange(16.0)}).result(60).path
    assert path is not None
    manifest = asyncckpt._manifest.read_manifest(path)
    assert json.loads(manifest.to_json())["format_version"] == 3
    record = manifest.tensors[0]
    wide = TensorRecord(**{**record.__dict__, "codec": "ans", "codec_params": {"planes": 4, "planes_span": "tensor"}})
    doc = json.loads(type(manifest)(**{**manifest.__dict__, "tensors": [wide]}).to_json())
    assert doc["format_version"] == 3
    del doc[DIGEST_FIELD]
    for version in (1, 2):
        old = parse_manifest(json.dumps({**doc, "format_version": version}).encode(), "test")
        assert (old.format_version, old.digest) == (version, None)
    with pytest.raises(asyncckpt.CorruptCheckpointError, match="must begin with its manifest_sha256"):
        parse_manifest(json.dumps(doc).encode(), "test")  # a version-3 manifest whose seal is gone
