"""The GPU I/O helpers below the pipeline: the pinned POSIX reader and writer of compat mode,
and the batched range copy that packs compressed chunks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gpu_env import requires_gpu

from asyncckpt._gpu import kernels, pinned_io
from asyncckpt._storage import ALIGNMENT
from asyncckpt.errors import CorruptCheckpointError

pytestmark = requires_gpu


def test_pinned_reader_reads_exact_ranges_across_pieces_and_reports_a_short_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pinned_io, "PIECE_BYTES", 4096)  # many pieces: both pinned buffers reused
    data = np.random.default_rng(3).integers(0, 256, 50_000, dtype=np.uint8)
    path = tmp_path / "blob.bin"
    path.write_bytes(data.tobytes())
    device = torch.device("cuda", torch.cuda.current_device())
    reader = pinned_io.PinnedPosixReader(path, device)
    try:
        requests = [(0, 50_000), (123, 9_000), (40_961, 9_039), (7, 0)]
        started = [(offset, size, *reader.read_async(offset, size)) for offset, size in requests]
        for offset, size, out, future in started:  # queued together, finished in order
            reader.finish(future, offset, size)
            assert out.is_cuda and torch.equal(out.cpu(), torch.from_numpy(data[offset : offset + size].copy()))
        out, future = reader.read_async(49_000, 2_000)
        with pytest.raises(CorruptCheckpointError, match="truncated"):
            reader.finish(future, 49_000, 2_000)
    finally:
        reader.close()


def test_pinned_writer_writes_device_and_host_buffers_at_aligned_offsets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pinned_io, "PIECE_BYTES", 4096)  # many pieces per buffer: copy k+1 overlaps write k
    device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=device).manual_seed(9)
    buffers = [
        torch.randint(0, 256, (n,), dtype=torch.uint8, device=device, generator=gen)
        for n in (50_001, 1, 0, 4096, 12_289)
    ]
    buffers.insert(2, torch.arange(7_000, dtype=torch.int64).to(torch.uint8))  # a host buffer among device ones
    torch.cuda.synchronize()  # appended device bytes are complete (the BlobWriter contract)
    path = tmp_path / "data.bin"
    writer = pinned_io.PinnedPosixWriter(path, device, inflight_bytes=10_000)  # appends wait for older writes
    try:
        offsets = [writer.append(b) for b in buffers]
        size = writer.sync()
    finally:
        writer.close()
    content = path.read_bytes()
    assert size == offsets[-1] + buffers[-1].numel() == len(content)
    for offset, buf in zip(offsets, buffers, strict=True):
        assert offset % ALIGNMENT == 0
        assert content[offset : offset + buf.numel()] == buf.cpu().numpy().tobytes()
    with pytest.raises(FileExistsError):  # a data file is written once
        pinned_io.PinnedPosixWriter(path, device, inflight_bytes=10_000)


def test_pinned_writer_does_not_wait_for_work_queued_on_the_callers_stream(tmp_path: Path) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    data = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, device=device)
    torch.cuda.synchronize()
    path = tmp_path / "data.bin"
    writer = pinned_io.PinnedPosixWriter(path, device, inflight_bytes=1 << 20)
    try:
        torch.cuda._sleep(4_000_000_000)  # seconds of GPU clock cycles queued on the caller's stream, as training's
        offset = writer.append(data)
        size = writer.sync()
        caller_still_busy = not torch.cuda.current_stream(device).query()
    finally:
        torch.cuda.synchronize()
        writer.close()
    assert caller_still_busy, "the write waited for the caller's stream"
    assert offset == 0 and size == data.numel() and path.read_bytes() == data.cpu().numpy().tobytes()


def test_copy_ranges_packs_chunks_at_any_alignment() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    stream = torch.cuda.Stream(device=device)
    gen = torch.Generator(device=device).manual_seed(5)
    source = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device=device, generator=gen)
    sizes = np.array([0, 1, 3, 4, 5, 4099, 65_537, 300_001], dtype=np.int64)
    src_offsets = np.array([0, 16, 33, 64, 101, 4096, 9000, 600_000], dtype=np.int64)  # odd source alignments
    dst_offsets = np.concatenate(([0], np.cumsum(sizes)[:-1])) + 1  # every destination misaligned
    packed = torch.zeros(int(sizes.sum()) + 8, dtype=torch.uint8, device=device)
    table = kernels.copy_ranges(source.data_ptr() + src_offsets, packed.data_ptr() + dst_offsets, sizes, device, stream)
    stream.synchronize()
    del table
    expected = torch.cat([source[o : o + n] for o, n in zip(src_offsets, sizes, strict=True)])
    assert torch.equal(packed[1 : 1 + int(sizes.sum())], expected)
    assert packed[0] == 0 and not packed[1 + int(sizes.sum()) :].any()  # nothing written outside the ranges


@pytest.mark.parametrize("planes", [2, 4, 8])
@pytest.mark.parametrize("items", [1, 3, 4, 4099, 1 << 20])
def test_plane_kernels_match_the_cpu_layout(planes: int, items: int) -> None:
    from asyncckpt._gpu.planes import join_tensor_into, plane_stride, split_tensor_into

    gen = torch.Generator().manual_seed(items * planes)
    raw = torch.randint(0, 256, (items * planes + 1,), dtype=torch.uint8, generator=gen)[1:]  # odd address
    rows = planes * plane_stride(raw.numel(), planes)
    expected = torch.zeros(rows, dtype=torch.uint8)
    split_tensor_into(raw, expected, planes)  # the CPU path: a strided torch copy
    on_gpu = torch.zeros(rows, dtype=torch.uint8, device="cuda")
    split_tensor_into(raw.cuda(), on_gpu, planes)
    assert torch.equal(on_gpu.cpu(), expected)
    back = torch.empty(raw.numel() + 1, dtype=torch.uint8, device="cuda")[1:]
    join_tensor_into(on_gpu, back, planes)
    assert torch.equal(back.cpu(), raw)
