"""The parts of the GPU path that run without a GPU: missing-package errors, CPU decoders for the
standard formats nvCOMP writes (RAW lz4 blocks, raw DEFLATE), plane layout, device checksum
arithmetic, codec specs, and the convert command on the CPU path."""

from __future__ import annotations

import itertools
import json
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_python, small_training_state
from gpu_env import subprocess_env

import asyncckpt
from asyncckpt._codecs import get_decoder, planes
from asyncckpt._gpu.planes import join_into, split_into
from asyncckpt._gpu.specs import CodecSpec, auto_candidates, spec_for, spec_from_manifest
from asyncckpt._manifest import MANIFEST_NAME
from asyncckpt._manifest_digest import DIGEST_FIELD, seal
from asyncckpt.cli import main as cli
from asyncckpt.errors import CorruptCheckpointError
from asyncckpt.testing.state_compare import clone_state, first_difference

_BLOCK_GPU_PACKAGES = """
import sys
sys.modules["nvidia.nvcomp"] = None   # an import of these now raises ImportError, installed or not
sys.modules["kvikio"] = None
import torch, asyncckpt
for codec in ("ans", "bitcomp"):
    try:
        asyncckpt.AsyncCheckpointer(sys.argv[1], codec=codec)
    except asyncckpt.CheckpointError as exc:  # MissingDependencyError here; without CUDA it would say so
        print("ERROR:", type(exc).__name__, exc)
    else:
        print("NO ERROR")
"""


def test_import_works_and_gpu_codecs_name_the_pip_line_without_gpu_packages(tmp_path: Path) -> None:
    out = run_python(_BLOCK_GPU_PACKAGES, str(tmp_path / "run"), env=subprocess_env()).stdout
    assert "NO ERROR" not in out and out.count("ERROR: MissingDependencyError") == 2
    assert out.count('pip install "asyncckpt[cu12]"') == 2 and out.count('pip install "asyncckpt[cu13]"') == 2


def _sample_floats(n: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(n, generator=gen) * 0.02).to(dtype)


def _raw_chunks(
    raw: np.ndarray, chunk: int, planes_count: int, compress: object
) -> tuple[bytes, list[tuple[int, int]]]:
    blob, chunks = b"", []
    for start in range(0, raw.size, chunk):
        piece = planes.split(raw[start : start + chunk], planes_count)
        frame = compress(piece.tobytes())  # type: ignore[operator]
        blob += frame
        chunks.append((len(frame), piece.size))
    return blob, chunks


def _raw_deflate(data: bytes) -> bytes:
    deflater = zlib.compressobj(6, zlib.DEFLATED, -15)
    return deflater.compress(data) + deflater.flush()


def _lz4_block(data: bytes) -> bytes:
    import lz4.block

    return bytes(lz4.block.compress(data, store_size=False))


@pytest.mark.parametrize("codec", ["lz4", "deflate"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_cpu_decoders_read_raw_chunks_with_planes(codec: str, dtype: torch.dtype) -> None:
    if codec == "lz4":
        pytest.importorskip("lz4")
    tensor = _sample_floats(70_000, dtype) if dtype.is_floating_point else torch.arange(70_000, dtype=dtype)
    raw = tensor.view(torch.uint8).numpy()
    planes_count = spec_for(codec, dtype).planes
    blob, chunks = _raw_chunks(raw, 65536, planes_count, _lz4_block if codec == "lz4" else _raw_deflate)
    out = torch.empty(raw.size, dtype=torch.uint8)
    get_decoder(codec, "test").decode(
        torch.frombuffer(bytearray(blob), dtype=torch.uint8), chunks, {"planes": planes_count}, out
    )
    assert torch.equal(out.view(dtype), tensor)


@pytest.mark.parametrize("codec", ["lz4", "deflate"])
def test_cpu_decoders_reject_corrupt_and_missized_chunks(codec: str) -> None:
    if codec == "lz4":
        pytest.importorskip("lz4")
    raw = _sample_floats(20_000, torch.float32).view(torch.uint8).numpy()
    blob, chunks = _raw_chunks(raw, 1 << 20, 4, _lz4_block if codec == "lz4" else _raw_deflate)
    decoder = get_decoder(codec, "test")
    out = torch.empty(raw.size, dtype=torch.uint8)
    truncated = bytearray(blob[: chunks[0][0] - 16])  # a chunk cut short never decodes to its raw size
    with pytest.raises(CorruptCheckpointError):
        decoder.decode(
            torch.frombuffer(truncated, dtype=torch.uint8), [(len(truncated), chunks[0][1])], {"planes": 4}, out
        )
    with pytest.raises(CorruptCheckpointError):  # the manifest claims a larger raw size than the chunk holds
        decoder.decode(
            torch.frombuffer(bytearray(blob), dtype=torch.uint8),
            [(chunks[0][0], chunks[0][1] + 4)],
            {"planes": 4},
            torch.empty(raw.size + 4, dtype=torch.uint8),
        )
    with pytest.raises(CorruptCheckpointError, match="planes"):
        decoder.decode(torch.frombuffer(bytearray(blob), dtype=torch.uint8), chunks, {"planes": 3}, out)


@pytest.mark.parametrize("planes_count", [2, 4, 8])
def test_device_plane_layout_is_the_cpu_layout_per_chunk(planes_count: int) -> None:
    gen = torch.Generator().manual_seed(planes_count)
    raw = torch.randint(0, 256, (4096 * 3 + 1024 + 8 * 5,), dtype=torch.uint8, generator=gen)
    split = torch.empty_like(raw)
    split_into(raw, split, 4096, planes_count)
    expected = np.concatenate(
        [planes.split(raw.numpy()[s : s + 4096], planes_count) for s in range(0, raw.numel(), 4096)]
    )
    assert np.array_equal(split.numpy(), expected)
    back = torch.empty_like(raw)
    join_into(split, back, 4096, planes_count)
    assert torch.equal(back, raw)


@pytest.mark.parametrize("nbytes", [4, 4096 * 4, 4096 * 4 * 3 + 12])
def test_tensor_wide_planes_cut_each_plane_into_its_own_chunks(nbytes: int) -> None:
    from asyncckpt._gpu.decoders import DecodeItem, _wide_chunk_offsets
    from asyncckpt._gpu.planes import join_tensor_into, plane_chunks, plane_stride, split_tensor_into

    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))
    stride = plane_stride(nbytes, 4)
    assert stride % 16 == 0 and stride >= nbytes // 4
    split = torch.zeros(4 * stride, dtype=torch.uint8)
    split_tensor_into(raw, split, 4)
    for j in range(4):  # row j holds byte j of every element
        assert torch.equal(split[j * stride : j * stride + nbytes // 4], raw[j::4])
    chunks = plane_chunks(nbytes, 4, 4096)
    assert sum(n for _o, n in chunks) == nbytes and all(o // stride == (o + n - 1) // stride for o, n in chunks)
    item = DecodeItem(torch.empty(0), [(1, n) for _o, n in chunks], torch.empty(nbytes, dtype=torch.uint8), "t")
    assert _wide_chunk_offsets(item, 4) == [o for o, _n in chunks]  # the decoder finds the same places
    back = torch.empty_like(raw)
    join_tensor_into(split, back, 4)
    assert torch.equal(back, raw)
    if len(chunks) > 1:  # hostile tables: a chunk across a plane boundary, planes not filled
        per = len(chunks) // 4  # chunks per plane: merge the last of plane 0 with the first of plane 1
        sizes = [n for _o, n in chunks]
        merged = [(1, n) for n in [*sizes[: per - 1], sizes[per - 1] + sizes[per], *sizes[per + 1 :]]]
        bad = [DecodeItem(item.blob, merged, item.out, "t"), DecodeItem(item.blob, item.chunks[:-1], item.out, "t")]
        for hostile in bad:
            with pytest.raises(CorruptCheckpointError, match="plane"):
                _wide_chunk_offsets(hostile, 4)


def test_the_pipeline_chunk_table_matches_the_chunk_layouts() -> None:
    from asyncckpt._gpu.batch import split_chunks
    from asyncckpt._gpu.pipeline import chunk_table
    from asyncckpt._gpu.planes import plane_chunks

    chunk = 4096
    for nplanes, sizes, layout in [
        (
            1,
            [4096 * 3, 5, 4096 * 3 + 12, 4096],
            lambda n: [(k * chunk, m) for k, m in enumerate(split_chunks(n, chunk))],
        ),
        (4, [4096 * 4 * 3 + 12, 64, 4096 * 8], lambda n: plane_chunks(n, 4, chunk)),
    ]:
        bases = [k * 65_536 for k in range(len(sizes))]
        offsets, raw, ranges = chunk_table(sizes, bases, chunk, nplanes)
        expected = [(b + o, m) for b, n in zip(bases, sizes, strict=True) for o, m in layout(n)]
        assert list(zip(offsets.tolist(), raw.tolist(), strict=True)) == expected
        assert [end - first for first, end in ranges] == [len(layout(n)) for n in sizes]
        assert ranges[0][0] == 0 and ranges[-1][1] == len(expected)
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    offsets, raw, ranges = chunk_table([0, 4096, 3], [0, 4096, 8192], chunk, 4)  # empty and sub-item tensors
    assert raw.tolist() == [1024] * 4 and ranges == [(0, 0), (0, 4), (4, 4)]


def test_the_nvcomp_c_api_is_simply_unavailable_without_the_library() -> None:
    code = """
import sys
sys.modules["nvidia"] = None  # no nvidia-* wheel at all, installed or not
from asyncckpt._gpu import native
from asyncckpt._gpu.specs import CodecSpec
print(native.available(CodecSpec("ans", "<f4")), native.available(CodecSpec("zstd")))
"""
    result = run_python(code, env=subprocess_env(LD_LIBRARY_PATH=""))
    assert result.stdout.split() == ["False", "False"]


def test_specs_follow_the_documented_choices() -> None:
    assert spec_for("ans", torch.bfloat16) == CodecSpec("ans", "<f2")
    assert spec_for("ans", torch.float32) == CodecSpec("ans", "<f4")
    assert spec_for("ans", torch.int64) == CodecSpec("ans", "|u1")
    assert spec_for("zstd", torch.float32).planes == 4 and spec_for("zstd", torch.int32).planes == 1
    assert spec_for("bitcomp", torch.float16) == CodecSpec("bitcomp", "<f2")
    wide = CodecSpec("ans", "|u1", 4, "tensor")
    assert wide in auto_candidates(torch.float32) and CodecSpec("ans", "|u1", 2, "tensor") in auto_candidates(
        torch.bfloat16
    )
    assert spec_from_manifest("ans", wide.params(), "test") == wide
    assert "planes_span" not in spec_for("zstd", torch.float32).params()  # per-chunk planes read as before
    hostile = [{"planes": 3}, {"planes": "4"}, {"planes": 1, "data_type": "<f3"}, {"planes": 1, "data_type": 5}]
    hostile += [
        {"planes": 2, "planes_span": "file"},
        {"planes": 2, "planes_span": 1},
        {"planes": 2, "planes_span": None},
        {"planes": 1, "planes_span": "tensor"},
    ]
    for params in hostile:
        with pytest.raises(CorruptCheckpointError):
            spec_from_manifest("ans", params, "test")
    with pytest.raises(CorruptCheckpointError):
        spec_from_manifest("snappy", {}, "test")
    with pytest.raises(CorruptCheckpointError, match="planes_span"):  # a GPU would read it, a CPU would not
        spec_from_manifest("zstd", {"planes": 4, "planes_span": "tensor"}, "test")
    with pytest.raises(CorruptCheckpointError, match="planes_span"):  # the CPU decoders know per-chunk planes only
        get_decoder("zstd", "test").decode(
            torch.zeros(8, dtype=torch.uint8),
            [(8, 8)],
            {"planes": 2, "planes_span": "tensor"},
            torch.empty(8, dtype=torch.uint8),
        )


def _forge_codec(checkpoint: Path, codec: str) -> None:
    path = checkpoint / MANIFEST_NAME
    doc = json.loads(path.read_text())
    for record in doc["tensors"]:
        record["codec"] = codec
    del doc[DIGEST_FIELD]
    path.write_bytes(seal(doc))


def test_a_gpu_only_codec_fails_on_a_cpu_machine_with_an_error_that_says_so(run_dir: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine can decode GPU codecs")
    _model, _opt, state = small_training_state()
    with asyncckpt.AsyncCheckpointer(run_dir, codec="none") as ckpt:
        ckpt.save(1, state)
    _forge_codec(run_dir / "step-0000000001", "ans")
    with pytest.raises(asyncckpt.CheckpointError, match=r"(?s)needs a CUDA GPU.*asyncckpt\[cu12\].*convert"):
        asyncckpt.load(run_dir)


def test_convert_reencodes_on_the_cpu_and_exports_safetensors(tmp_path: Path, run_dir: Path) -> None:
    model, _opt, state = small_training_state()
    reference = clone_state(state)
    with asyncckpt.AsyncCheckpointer(run_dir, codec="none") as ckpt:
        ckpt.save(7, state, metadata={"note": "x"})
    out = tmp_path / "converted"
    assert cli(["convert", str(run_dir), str(out), "--codec", "zstd"]) == 0
    converted = asyncckpt.load(out)
    assert first_difference(reference, converted) is None
    manifest = json.loads((out / "step-0000000007" / MANIFEST_NAME).read_text())
    assert {t["codec"] for t in manifest["tensors"]} <= {"zstd", "none"} and manifest["metadata"] == {"note": "x"}
    assert asyncckpt.verify(out).tensors == len(manifest["tensors"])

    target = tmp_path / "state.safetensors"  # the model's state dict, as load_state_dict takes it
    assert cli(["convert", str(out), str(target), "--to", "safetensors"]) == 0
    safetensors_torch = pytest.importorskip("safetensors.torch")
    loaded = safetensors_torch.load_file(str(target))
    assert loaded.keys() == reference["model"].keys()
    model.load_state_dict(loaded)
    assert first_difference(reference["model"], model.state_dict()) is None


def test_the_pack_table_lists_each_kept_chunk_once_back_to_back() -> None:
    # The addresses the GPU pack kernel copies, computed on the host (CPU tensors stand in for
    # nvCOMP's output buffers): each tensor's kept chunks, from their output slots, to its blob.
    from asyncckpt._gpu.batch import PendingEncode
    from asyncckpt._gpu.pipeline import _copy_table, _Option

    out_a, out_b = torch.zeros(4 * 64, dtype=torch.uint8), torch.zeros(3 * 64, dtype=torch.uint8)
    a = PendingEncode(CodecSpec("ans", "<f4"), [64] * 4, out_a, [0, 64, 128, 192], None, _sizes=[10, 0, 7, 64])
    b = PendingEncode(CodecSpec("bitcomp", "<f4"), [64] * 3, out_b, [0, 64, 128], None, _sizes=[5, 6, 7])
    chosen = [_Option(10, a.spec, a, 0, 2), _Option(13, b.spec, b, 1, 3), _Option(71, a.spec, a, 2, 4)]
    sources, targets, sizes = _copy_table(chosen, [0, 16, 32], 1000)
    assert sizes.tolist() == [10, 0, 6, 7, 7, 64]
    pa, pb = out_a.data_ptr(), out_b.data_ptr()
    assert sources.tolist() == [pa, pa + 64, pb + 64, pb + 128, pa + 128, pa + 192]
    assert targets.tolist() == [1000, 1010, 1016, 1022, 1032, 1039]
    empty = _copy_table([], [], 1000)
    assert all(len(column) == 0 for column in empty)
