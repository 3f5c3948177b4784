"""The order in which a ``fence`` save hands groups to the writer, searched on the CPU.

``GpuEncoder._compress_fenced`` drives nvCOMP and three CUDA streams, which need a GPU; here its
kernels are modelled (as in tests/test_compress_retry.py): an encode fails with ``OutOfMemoryError``
when the raw bytes of the groups in flight (queued, neither packed nor dropped) would exceed the
modelled memory, and a pack or a copy to pinned memory is an event that lands when the host waits
for it. The loop itself, its retry path, and the real pinned pool (unpinned here) and reservation
run as they are. Every tensor must reach the writer exactly once and in order, each copy only after
it landed; a tensor is stored raw only if it does not fit alone; at most one packed group's copy is
in flight (each holds its GPU buffer) whenever the next group is queued; and the gate opens after
every group was packed. The real streams run in tests/gpu/test_gpu_full.py.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncckpt._codecs.base import EncodedBlob
from asyncckpt._gpu.pinned_pool import PinnedPool
from asyncckpt._gpu.pipeline import CompressStats, GpuEncoder, _Outgoing, _Packed
from asyncckpt._gpu.spill_reservation import SpillHistory
from asyncckpt._snapshot import StagedTensor

KiB = 1 << 10


@dataclass
class ModelEvent:
    """Stands in for a CUDA event; the log says when the host waited for it."""

    name: str
    log: list[str]
    landed: Any = None
    """Called once the host has waited for it (a copy: one fewer in flight)."""

    def synchronize(self) -> None:
        self.log.append(f"landed {self.name}")
        if self.landed is not None:
            self.landed()
            self.landed = None


@dataclass
class ModelledFence:
    """The encoder's GPU side, modelled; ``log`` records what the fenced loop did, in order."""

    memory: int
    log: list[str] = field(default_factory=list)
    in_flight: weakref.WeakSet[ModelWork] = field(default_factory=weakref.WeakSet)
    """Groups queued and neither packed nor dropped by the loop (their scratch is held)."""
    stored_raw: list[int] = field(default_factory=list)
    packed_copies_in_flight: int = 0
    """Copies of packed groups not yet waited for: each holds its GPU buffer until then."""
    most_in_flight_at_enqueue: int = 0
    _spill_history: SpillHistory = field(default_factory=SpillHistory)

    _plan = GpuEncoder._plan
    _hand_over = staticmethod(GpuEncoder._hand_over)

    def _enqueue(self, group: list[tuple[int, StagedTensor]], session: Any = None, probe: bool = True) -> ModelWork:
        self.most_in_flight_at_enqueue = max(self.most_in_flight_at_enqueue, self.packed_copies_in_flight)
        work = ModelWork(group)
        if work.nbytes + sum(w.nbytes for w in self.in_flight) > self.memory:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (modelled)")
        self.in_flight.add(work)
        return work

    def _pack(self, work: ModelWork, stats: CompressStats) -> _Packed:
        self.in_flight.discard(work)
        group, nbytes = work.group, work.nbytes  # "compressed" to its raw size
        buffer = torch.zeros(max(1, nbytes), dtype=torch.uint8)
        blobs, position = [], 0
        for index, t in group:
            n = t.data.numel()
            blobs.append((index, EncodedBlob(data=buffer[position : position + n], codec="ans", chunks=[(n, n)])))
            position += n
        self.log.append(f"packed {group[0][0]}")
        done = ModelEvent(f"pack {group[0][0]}", self.log)
        return _Packed(blobs, nbytes, buffer, done, None, [i for i, _ in group], [])  # type: ignore[arg-type]

    def _spill(self, snapshot: Any, packed: _Packed, stats: CompressStats) -> _Outgoing:
        copied = self._copy(f"copy {packed.blobs[0][0]}", holds_gpu_memory=True)
        host = torch.zeros(packed.buffer.numel(), dtype=torch.uint8)
        return _Outgoing(packed.nbytes, copied, packed, host=host, copying=True)  # type: ignore[arg-type]

    def _store_raw(self, snapshot: Any, group: list[tuple[int, StagedTensor]], stats: CompressStats) -> _Outgoing:
        ((index, t),) = group
        self.stored_raw.append(t.data.numel())
        copied = self._copy(f"copy {index}", holds_gpu_memory=False)  # reads the live tensor: no scratch
        blob = EncodedBlob(data=t.data, codec="none", chunks=[(t.data.numel(), t.data.numel())])
        return _Outgoing(t.data.numel(), copied, blobs=[(index, blob)], copying=True)  # type: ignore[arg-type]

    def _open_gate(self, gate: Any, stats: CompressStats, began: float, raw_copied: Any = None) -> None:
        self.log.append("gate")

    def _copy(self, name: str, holds_gpu_memory: bool) -> ModelEvent:
        """A copy to pinned memory queued: in flight until the host has waited for it."""
        if not holds_gpu_memory:
            return ModelEvent(name, self.log)
        self.packed_copies_in_flight += 1

        def landed() -> None:
            self.packed_copies_in_flight -= 1

        return ModelEvent(name, self.log, landed)


class ModelWork:
    def __init__(self, group: list[tuple[int, StagedTensor]]) -> None:
        self.group = group
        self.nbytes = sum(t.data.numel() for _, t in group)


class Channel:
    cancelled = False

    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.indices: list[int] = []

    def put(self, group: list[tuple[int, EncodedBlob]], nbytes: int) -> bool:
        self.indices += [index for index, _ in group]
        self.log.append(f"handed {group[0][0]}")
        return True


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 64 * KiB), min_size=1, max_size=14),
    group_bytes=st.integers(16 * KiB, 128 * KiB),
    resident=st.integers(0, 256 * KiB),
    memory=st.integers(8 * KiB, 256 * KiB),
)
def test_a_fence_hands_every_tensor_over_once_in_order_after_its_copy_landed(
    sizes: list[int], group_bytes: int, resident: int, memory: int
) -> None:
    fence = ModelledFence(memory=memory)
    tensors = [
        StagedTensor(key=f"layers.{i}.weight", dtype=torch.uint8, shape=(n,), device=torch.device("cpu"),
                     data=torch.zeros(n, dtype=torch.uint8))
        for i, n in enumerate(sizes)
    ]  # fmt: skip
    channel = Channel(fence.log)
    pool = PinnedPool(1 << 30, pin=False)
    snapshot = SimpleNamespace(channel=channel, pool=pool,
                               plan=SimpleNamespace(resident_bytes=resident, group_bytes=group_bytes))  # fmt: skip
    gate = SimpleNamespace(mark_staged=lambda: None)
    groups = fence._plan(tensors, group_bytes)
    GpuEncoder._compress_fenced(fence, snapshot, gate, groups, CompressStats(mode="fence"), time.perf_counter())  # type: ignore[arg-type]
    pool.close()

    assert channel.indices == list(range(len(sizes))), "every tensor once, in order"
    assert all(n > memory for n in fence.stored_raw), ("stored raw though it fits alone", fence.stored_raw, memory)
    assert fence.most_in_flight_at_enqueue <= 1, "at most one packed group's copy in flight when the next is queued"
    log = fence.log
    gate_at = log.index("gate")
    assert not [e for e in log[gate_at:] if e.startswith("packed")], "the gate opens after every pack"
    for at, entry in enumerate(log):
        if entry.startswith("handed"):
            first = entry.split()[1]
            copy = f"landed copy {first}"
            if copy in log:  # a group that went to pinned memory is handed over once its copy landed
                assert log.index(copy) < at, (entry, log)
