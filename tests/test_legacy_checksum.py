"""Checkpoints whose blobs carry ``mix64`` (what the GPU path wrote until 2026-12-05) keep loading.

Such a checkpoint is made here from a CPU-written one: every record's checksum is replaced by
the ``mix64`` of its stored bytes and the manifest resealed, which is byte for byte what an older
GPU writer produced for the same blobs.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

import asyncckpt
from asyncckpt._checksum import mix64_host
from asyncckpt._manifest import MANIFEST_NAME, Checksum, read_manifest
from asyncckpt.testing.state_compare import first_difference


def _legacy_checkpoint(run_dir: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    state = {f"w{i}": torch.randn(257 * (i + 1)) for i in range(4)}
    state["empty"] = torch.empty(0)
    with asyncckpt.AsyncCheckpointer(run_dir, codec="zstd") as ckpt:
        path = ckpt.save(1, state).result(60).path
    manifest = read_manifest(path)
    records = []
    for record in manifest.tensors:
        stored = np.fromfile(path / record.file, dtype=np.uint8, count=record.stored_bytes, offset=record.offset)
        records.append(dataclasses.replace(record, checksum=Checksum("mix64", mix64_host(stored))))
    (path / MANIFEST_NAME).write_bytes(dataclasses.replace(manifest, tensors=records).to_json())
    return path, state


def test_a_mix64_checkpoint_loads_bit_exact_and_verifies(tmp_path: Path) -> None:
    path, state = _legacy_checkpoint(tmp_path)
    assert {r.checksum.algorithm for r in read_manifest(path).tensors} == {"mix64"}
    assert first_difference(state, asyncckpt.load(tmp_path)) is None
    report = asyncckpt.verify(path)
    assert report.tensors == len(state) and report.manifest_digest is not None


@pytest.mark.parametrize("which", range(4))
def test_a_damaged_mix64_blob_is_reported_with_its_algorithm(tmp_path: Path, which: int) -> None:
    path, _ = _legacy_checkpoint(tmp_path)
    record = read_manifest(path).tensors[which]
    with open(path / record.file, "r+b") as f:
        f.seek(record.offset + record.stored_bytes // 2)
        byte = f.read(1)[0]
        f.seek(record.offset + record.stored_bytes // 2)
        f.write(bytes([byte ^ 0x01]))
    with pytest.raises(asyncckpt.CorruptCheckpointError, match=rf"(?s){record.key}.*checksum mismatch \(mix64 stored"):
        asyncckpt.load(tmp_path)
