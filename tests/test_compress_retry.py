"""How a staged copy's compressor degrades when GPU memory runs short, on the CPU.

``GpuEncoder._compress_stable`` drives nvCOMP through ``_enqueue``/``_resolve``, which need a GPU;
here they are replaced by a model of a GPU with a fixed amount of memory (a part whose bytes
exceed it fails with ``torch.cuda.OutOfMemoryError``, as the allocator would), so the splitting,
ordering and raw-storing logic is searched over many sizes. The real kernels under memory
pressure are exercised on the H200 (tests/gpu/test_gpu_full.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncckpt._codecs.base import EncodedBlob
from asyncckpt._gpu.budget import NO_LIMIT
from asyncckpt._gpu.pipeline import MIN_RETRY_GROUP_BYTES, CompressStats, GpuEncoder
from asyncckpt._snapshot import StagedTensor

MiB = 1 << 20


@dataclass
class GpuWithLittleMemory:
    """Stands in for the encoder: a part fits when its raw bytes do not exceed ``memory``."""

    memory: int
    attempts: list[tuple[list[int], bool]] = field(default_factory=list)

    def _enqueue(self, part: list[tuple[int, StagedTensor]], session: Any = None, probe: bool = True) -> Any:
        self.attempts.append(([index for index, _ in part], probe))
        if sum(t.data.numel() for _, t in part) > self.memory:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (modelled)")
        return part

    def _resolve(self, part: list[tuple[int, StagedTensor]], stats: CompressStats) -> Any:
        blobs = [
            (index, EncodedBlob(data=t.data[:1], codec="modelled", chunks=[(1, t.data.numel())])) for index, t in part
        ]
        return blobs, len(blobs), None


def staged(index: int, nbytes: int) -> tuple[int, StagedTensor]:
    data = torch.zeros(1, dtype=torch.uint8).expand(nbytes) if nbytes else torch.empty(0, dtype=torch.uint8)
    return index, StagedTensor(
        key=f"t{index}", dtype=torch.uint8, shape=(nbytes,), device=torch.device("cpu"), data=data
    )


def snapshot_with(limit: int) -> Any:
    return SimpleNamespace(plan=SimpleNamespace(max_compress_bytes=limit), channel=SimpleNamespace(cancelled=False))


@settings(max_examples=300, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=0, max_value=64 * MiB), min_size=1, max_size=24),
    memory=st.integers(min_value=MIN_RETRY_GROUP_BYTES, max_value=128 * MiB),
    limit=st.sampled_from([NO_LIMIT, 32 * MiB]),
)
def test_a_short_copy_splits_until_it_fits_and_stores_raw_only_what_never_fits(
    sizes: list[int], memory: int, limit: int
) -> None:
    gpu = GpuWithLittleMemory(memory)
    stats = CompressStats(mode="device")
    group = [staged(i, n) for i, n in enumerate(sizes)]
    blobs, nbytes = GpuEncoder._compress_stable(gpu, group, snapshot_with(limit), stats)  # type: ignore[arg-type]

    assert [index for index, _ in blobs] == list(range(len(sizes)))  # every tensor once, in order
    raw = {index for index, blob in blobs if blob.codec == "none"}
    assert raw == {i for i, n in enumerate(sizes) if n > limit or n > memory}
    assert all(blob.data.numel() == sizes[index] for index, blob in blobs if index in raw)
    assert nbytes == sum(sizes[i] for i in raw) + len(sizes) - len(raw)
    # Only the first attempt may probe every auto candidate; a retry uses one codec per tensor.
    assert all(not probe for _, probe in gpu.attempts[1:])
    failed = [part for part, _ in gpu.attempts if sum(sizes[i] for i in part) > memory]
    assert stats.short_parts == len(failed)
    assert stats.short_raw_tensors == len({i for i in raw if sizes[i] <= limit})
    # Halving bounds the work: at most two attempts per tensor, plus the first.
    assert len(gpu.attempts) <= 2 * len(sizes) + 1


def test_a_cancelled_save_stops_retrying() -> None:
    gpu = GpuWithLittleMemory(memory=0)
    snapshot = snapshot_with(NO_LIMIT)
    snapshot.channel.cancelled = True
    blobs, _ = GpuEncoder._compress_stable(
        gpu, [staged(0, 8 * MiB), staged(1, 8 * MiB)], snapshot, CompressStats("device")
    )  # type: ignore[arg-type]
    assert gpu.attempts == [] and blobs == []
