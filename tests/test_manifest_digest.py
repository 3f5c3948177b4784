"""The manifest's own digest: every writer seals it, every reader checks it before trusting a field."""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import run_python
from hypothesis import given, settings
from hypothesis import strategies as st

import asyncckpt
import asyncckpt._persist as persist
from asyncckpt._delta_ops import DELTA_OPS
from asyncckpt._manifest import MANIFEST_NAME, Checksum, Manifest, Reference, TensorRecord, read_manifest
from asyncckpt._manifest_digest import DIGEST_FIELD, PREFIX_BYTES, seal
from asyncckpt.distributed import DistributedCheckpointer
from asyncckpt.integrations.dcp import AsyncCkptReader, AsyncCkptWriter


def _sealed(path: Path) -> bytes:
    data = (path / MANIFEST_NAME).read_bytes()
    assert data.startswith(b'{"manifest_sha256": "') and data[PREFIX_BYTES - 2 : PREFIX_BYTES] == b'",'
    assert data[21 : 21 + 64].decode() == hashlib.sha256(data[PREFIX_BYTES:]).hexdigest()
    assert json.loads(data)["format_version"] == 3
    return data


@pytest.fixture
def checkpoint(run_dir: Path) -> Path:
    with asyncckpt.AsyncCheckpointer(run_dir) as ckpt:
        return ckpt.save(1, {"model": {"w": torch.arange(8.0)}, "lr": 0.5}).result().path  # type: ignore[return-value]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # DCP in one process
def test_every_writer_seals_its_manifest(checkpoint: Path, tmp_path: Path) -> None:
    _sealed(checkpoint)
    assert asyncckpt.verify(checkpoint).manifest_digest == read_manifest(checkpoint).digest is not None

    ranks = [DistributedCheckpointer(tmp_path / "dist", rank=r, world_size=2, session="s1") for r in (0, 1)]
    handles = [ckpt.save(5, {"x": torch.full((4,), float(r))}) for r, ckpt in enumerate(ranks)]
    for handle in handles:
        handle.result(timeout=30)
    for ckpt in ranks:
        ckpt.close()
    _sealed(tmp_path / "dist" / "step-0000000005")
    assert asyncckpt.verify(tmp_path / "dist").tensors == 2

    dcp.save({"w": torch.ones(3)}, storage_writer=AsyncCkptWriter(tmp_path / "dcp"), no_dist=True)
    _sealed(tmp_path / "dcp")
    back = {"w": torch.zeros(3)}
    dcp.load(back, storage_reader=AsyncCkptReader(tmp_path / "dcp"), no_dist=True)
    assert torch.equal(back["w"], torch.ones(3))


@pytest.mark.parametrize("position", ["digest line", "key", "value", "last byte"])
def test_a_changed_byte_anywhere_is_refused_by_load_and_verify(checkpoint: Path, position: str) -> None:
    path = checkpoint / MANIFEST_NAME
    data = bytearray(path.read_bytes())
    at = {"digest line": 30, "key": data.index(b'"model"') + 2, "value": data.index(b'"step": 1') + 8,
          "last byte": len(data) - 1}[position]  # fmt: skip
    data[at] ^= 0x04  # model -> mkdel, 1 -> 5, a digest digit, "}" -> "y"
    path.write_bytes(bytes(data))
    for check in (asyncckpt.load, asyncckpt.verify):
        with pytest.raises(asyncckpt.CorruptCheckpointError, match=r"manifest\.json: manifest digest mismatch|"
                           r"manifest\.json: the manifest's manifest_sha256 is malformed"):  # fmt: skip
            check(checkpoint)


def test_appended_and_truncated_manifests_are_refused(checkpoint: Path) -> None:
    path = checkpoint / MANIFEST_NAME
    data = path.read_bytes()
    for changed in (data + b"\n", data[:-1], data[:PREFIX_BYTES], data[:40]):
        path.write_bytes(changed)
        with pytest.raises(asyncckpt.CorruptCheckpointError, match="manifest"):
            asyncckpt.verify(checkpoint)


def test_a_damaged_seal_is_not_taken_for_an_older_unsealed_manifest(checkpoint: Path) -> None:
    path = checkpoint / MANIFEST_NAME
    data = path.read_bytes()
    path.write_bytes(data.replace(b'"manifest_sha256"', b'"manifest_sha257"', 1))
    with pytest.raises(asyncckpt.CorruptCheckpointError, match="version 3 manifest must begin with its"):
        asyncckpt.load(checkpoint)


@pytest.mark.parametrize("version", [1, 2])
def test_older_unsealed_manifests_still_load_and_verify_says_what_was_not_checked(
    checkpoint: Path, version: int
) -> None:
    path = checkpoint / MANIFEST_NAME
    doc = json.loads(path.read_bytes())
    del doc[DIGEST_FIELD]
    doc["format_version"] = version
    path.write_text(json.dumps(doc, indent=1))  # as versions 1 and 2 wrote it
    state = asyncckpt.load(checkpoint)
    assert torch.equal(state["model"]["w"], torch.arange(8.0)) and state["lr"] == 0.5
    report = asyncckpt.verify(checkpoint)
    assert (report.format_version, report.manifest_digest) == (version, None)
    assert report.notes == [f"no manifest digest (format v{version})"]
    doc[DIGEST_FIELD] = "0" * 64  # an older manifest has none: a stray one is damage
    path.write_text(json.dumps(doc, indent=1))
    with pytest.raises(asyncckpt.CorruptCheckpointError, match=f"format version {version} manifest has no"):
        asyncckpt.load(checkpoint)


def test_the_cli_says_when_a_manifest_has_no_digest(checkpoint: Path) -> None:
    cli = "import sys; from asyncckpt.cli import main; sys.exit(main(sys.argv[1:]))"
    assert "no manifest digest" not in run_python(cli, "verify", str(checkpoint)).stdout
    path = checkpoint / MANIFEST_NAME
    doc = json.loads(path.read_bytes())
    del doc[DIGEST_FIELD]
    doc["format_version"] = 1
    path.write_text(json.dumps(doc, indent=1))
    out = run_python(cli, "verify", str(checkpoint)).stdout
    assert out.startswith("OK:") and out.rstrip().endswith("every checksum verified; no manifest digest (format v1)")
    assert json.loads(run_python(cli, "verify", "--json", str(checkpoint)).stdout)["notes"] == [
        "no manifest digest (format v1)"
    ]


_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(), children, max_size=3),
    max_leaves=8,
)
_RECORDS = st.builds(
    TensorRecord,
    key=st.text(),
    dtype=st.text(max_size=8),
    shape=st.lists(st.integers(0, 1 << 40), max_size=3),
    device=st.sampled_from(["cpu", "cuda:0"]),
    file=st.text(max_size=8),
    offset=st.integers(0, 1 << 50),
    stored_bytes=st.integers(0, 1 << 50),
    raw_bytes=st.integers(0, 1 << 50),
    codec=st.text(max_size=6),
    codec_params=st.dictionaries(st.text(max_size=6), _JSON_VALUES, max_size=3),
    chunks=st.lists(st.tuples(st.integers(0, 1 << 40), st.integers(0, 1 << 40)), max_size=6),
    checksum=st.builds(Checksum, algorithm=st.text(max_size=6), value=st.text(max_size=8)),
    delta=st.none() | st.sampled_from(sorted(DELTA_OPS)),
)


_REFERENCES = st.none() | st.builds(Reference, step=st.integers(0, 1 << 40), manifest_sha256=st.text(max_size=64))


@settings(max_examples=150, deadline=None)
@given(records=st.lists(_RECORDS, max_size=5), structure=st.dictionaries(st.text(), _JSON_VALUES, max_size=3),
       metadata=st.dictionaries(st.text(), _JSON_VALUES, max_size=3), step=st.integers(0, 1 << 62),
       reference=_REFERENCES)  # fmt: skip
def test_the_manifest_file_holds_its_fields_and_a_tensor_record_per_line(
    records: list[TensorRecord], structure: dict, metadata: dict, step: int, reference: Reference | None
) -> None:
    """The manifest is written with json's compact encoder and its own layout, not ``json.dumps`` of
    ``dataclasses.asdict`` (too slow on the worker thread for a large state); what it holds must be
    exactly that document's members, and each tensor record a line of its own."""
    if reference is None:
        records = [dataclasses.replace(r, delta=None) for r in records]
    manifest = Manifest(step=step, created_unix=1.5, library_version="x", tensors=records, structure=structure,
                        metadata=metadata, reference=reference)  # fmt: skip
    data = manifest.to_json()
    assert data[21 : 21 + 64].decode() == hashlib.sha256(data[PREFIX_BYTES:]).hexdigest()
    written = json.loads(data)
    expected = {DIGEST_FIELD: written[DIGEST_FIELD], **dataclasses.asdict(manifest)}
    del expected["digest"]
    expected["format_version"] = 4 if manifest.is_delta else 3
    if not manifest.is_delta:
        del expected["reference"]
        for record in expected["tensors"]:
            del record["delta"]
    expected = json.loads(json.dumps(expected))  # as JSON holds it: the chunk tuples become arrays
    assert written == expected
    assert list(written) == list(expected)  # the members in the dataclass's order, the digest first
    rows = [json.loads(line.rstrip(b",")) for line in data.splitlines() if line.startswith(b"  {")]
    assert rows == expected["tensors"]


def test_chunk_tables_leave_nothing_for_the_garbage_collector(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunk tables, as written and as read, are tuples of ints, which the GC stops tracking once it has
    looked at them: a list per chunk (31,000 for a 2.8B-parameter state) stayed tracked from the write to
    the commit and set off a full collection, every thread stopped, every few saves."""
    written = []
    write_part = persist.write_part

    def spy(*args: Any, **kwargs: Any) -> Any:  # the real write, its records kept
        part = write_part(*args, **kwargs)
        written.append(part)
        return part

    monkeypatch.setattr(persist, "write_part", spy)
    with asyncckpt.AsyncCheckpointer(run_dir, codec="zstd") as ckpt:
        path = ckpt.save(1, {"w": torch.randn(300_000), "b": torch.randn(7)}).result().path
    assert path is not None
    read = read_manifest(path)
    gc.collect()
    for records in (written[0].records, read.tensors):
        chunks = [c for record in records for c in record.chunks]
        assert len(chunks) >= 2 and not any(gc.is_tracked(c) for c in chunks)


@pytest.mark.parametrize("value", [float("nan"), float("-inf")])
def test_a_manifest_that_json_cannot_hold_exactly_is_refused(value: float) -> None:
    manifest = Manifest(step=1, created_unix=value, library_version="x", tensors=[], structure={})
    with pytest.raises(ValueError):
        manifest.to_json()


def test_a_member_name_that_is_not_a_string_is_refused() -> None:
    with pytest.raises(ValueError, match="str member names"):
        seal({"step": 1, 2: "a"})
