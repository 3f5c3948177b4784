"""The reference store of incremental checkpoints on the GPU path: the previous save's bytes kept
in GPU memory while a budget allows, else in pinned host memory, in memory allocated *between*
saves.

Same life cycle and protocol as :class:`~asyncckpt._delta_reference.HostReferenceStore` (begin,
reference, record, commit, invalidate); what differs is where a key's bytes live and when that
memory is allocated.

Where:

* in GPU memory, up to ``device_budget_bytes``. On the GPU path the stager sets it at every save
  to what the references hold plus the room that save's plan leaves in the one GPU budget
  (``gpu_staging_budget_bytes``; :func:`~asyncckpt._gpu.budget.reference_room`), so references
  never cost a save its mode or compression; a store used without a stager (the CPU tests) takes a
  quarter of the GPU memory free when it first allocates. A delta then costs one elementwise
  kernel and the update one device-to-device copy (~2 TB/s on an H200);
* past that, in pinned host memory (:func:`~asyncckpt._gpu.pinned_pool.allocate_block`: exact
  sizes, not torch's power-of-two blocks), up to ``host_budget_bytes``: the compressor uploads
  the reference to compute the delta and copies the new bytes back, both on its stream (~50 GB/s
  each way over PCIe);
* past both, not kept: that key is stored in full at every save.

When: a key is kept only in memory that already exists. :meth:`record` never allocates: a key
with no memory (every key of a checkpointer's first save) is stored without a reference, and its
size is noted. Once that save has committed, a background thread (``asyncckpt-reference-memory``)
allocates what was noted, and frees what was given up (a key gone from the state, a size that
changed, a delta ``auto`` gave up on); the next save copies into the new memory. So a
checkpointer's first two saves are full and its third is the first delta. (With
``delta_reference="full"`` a delta save copies nothing; when memory arrives for keys its full
save could not keep, :meth:`wants_full_save` makes the next save full, so they get references.)
:meth:`reserve` (what ``AsyncCheckpointer.preallocate`` calls) allocates ahead of the first save
instead, so that save keeps its references.

Why: records run on the compressor stream while a ``fence`` save holds training, and pinning runs
at a few GB/s under a driver lock. When the first save pinned its references as it went, it cost
training 4.28 s where the same save without delta cost 0.33 s (H100, 2026-12-06 00:35Z,
``benchmarks/results/delta-20261206-003507-h10080gbhbm3.md``; that checkpointer, created second in the
benchmark, was probably also fenced for want of budget, as the later runs that record the mode show).
On this thread it costs training little: steps of 39.2 ms took 41.4 ms while 80 MiB blocks were pinned
and freed in a loop beside them, and 41.7 ms alone at the end of the same run
(``python -m benchmarks.host_blocking --only reference --no-probes``, H100, 2026-12-06), and a
delta chain's saves lost what saves without delta lost (``...-051718-...md``). GPU references come
from torch's caching allocator and are never given back with ``empty_cache``: a ``cudaFree``
synchronises the device, and with it training (364 ms steps in the same benchmark). A failed or invalidated save
keeps the memory (as spare, for the same keys), so recovering from it pins nothing.

Streams and threads: :meth:`record` and :meth:`reference` run on the compressor thread (records
under the store's lock, which :meth:`invalidate` takes from any thread) and enqueue their copies on
its current stream, after the kernels that read the old bytes, never
waiting for them (the compressor synchronises its stream before a save can commit). GPU
memory is allocated for ``stream`` (the compressor's), so the caching allocator orders its reuse
on that stream. The background thread touches only spare memory and the byte counters, under the
store's lock; an out-of-memory error there leaves that key unkept, never a failed save.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch

from .._delta_reference import Base, HostReferenceStore
from .pinned_pool import PinnedBlock, allocate_block, free_block

__all__ = ["DeviceReferenceStore"]

log = logging.getLogger("asyncckpt")


@dataclass(eq=False)
class _Memory:
    """One key's reference memory: ``data`` (1-D uint8), in a pinned host ``block`` or on the GPU (None)."""

    data: torch.Tensor
    block: PinnedBlock | None


class DeviceReferenceStore(HostReferenceStore):
    """A reference store for CUDA tensors: device memory first, then pinned host memory, allocated
    between saves (see the module docstring)."""

    def __init__(self, device: torch.device, host_budget_bytes: int, device_budget_bytes: int | None = None,
                 stream: torch.cuda.Stream | None = None, pin: bool | None = None) -> None:  # fmt: skip
        """``stream``: the compressor's (GPU memory is allocated for it); ``pin``: register host memory
        with CUDA (default: when ``device`` is a GPU; the CPU tests run the store on host memory)."""
        super().__init__(host_budget_bytes)
        self.device = device
        self.device_budget_bytes = device_budget_bytes
        self.stream = stream
        self.pin = device.type == "cuda" if pin is None else pin
        self.min_record_bytes = 0
        """The smallest tensor the compressor records a reference for (set by the backend)."""
        self.device_bytes = 0
        """GPU bytes allocated for references (holding one or spare)."""
        self.host_bytes = 0
        """Pinned host bytes allocated for references (holding one or spare)."""
        self._memory: dict[str, _Memory] = {}
        """The memory behind each kept reference (``_bytes[key]`` is its ``data``)."""
        self._spare: dict[str, _Memory] = {}
        """Memory allocated for a key that holds no reference yet."""
        self._wanted: dict[str, int] = {}
        """Keys recorded without memory, and the bytes each needs."""
        self._retired: list[_Memory] = []
        """Memory given up, freed by the next background pass (its last copy may still be queued)."""
        self._preparing: threading.Thread | None = None
        self._not_kept: set[str] = set()
        """Keys the save being encoded recorded with ``keep=False``: spare memory that reaches one
        of them (a background pass that was already running) is freed at its commit."""

    def begin(self, step: int) -> Base | None:
        with self._lock:
            self._not_kept = set()
            return super().begin(step)

    # ------------------------------------------------------------------ compressor thread
    def reference(self, key: str, raw_bytes: int) -> torch.Tensor | None:
        """``key``'s bytes on this device (uploaded on the current stream when kept on the host)."""
        found = super().reference(key, raw_bytes)
        if found is None or found.device == self.device:
            return found
        return found.to(self.device, non_blocking=True)

    def record(self, key: str, raw: torch.Tensor, *, keep: bool = True) -> None:
        nbytes = raw.numel()
        with self._lock:  # invalidate() may move memory to spare from another thread
            if self._frozen:  # a delta save against the chain's full save: nothing to copy
                super().record(key, raw, keep=keep)
                if keep and key not in self._bytes:
                    self._wanted[key] = nbytes  # its memory will start the next chain (wants_full_save)
                return
            self._touched.add(key)
            held = self._bytes.get(key)
            if keep and held is not None and held.numel() == nbytes:
                held.copy_(raw, non_blocking=True)
                return
            if not keep:  # wanted by an earlier save (one that failed): not any more
                self._wanted.pop(key, None)
                self._not_kept.add(key)
            self._drop(key)
            spare = self._spare.pop(key, None)
            if spare is not None and (not keep or spare.data.numel() != nbytes):
                self._retired.append(spare)
                spare = None
            if spare is None:
                if keep:
                    self._wanted[key] = nbytes  # a pass that finds memory already there skips it
                return
            spare.data.copy_(raw, non_blocking=True)
            self._bytes[key] = spare.data
            self._memory[key] = spare
            self._held += nbytes

    def wants_full_save(self) -> bool:
        with self._lock:
            return bool(self._spare)

    # ------------------------------------------------------------------ training thread, in save()
    def give_up_device_memory(self) -> int:
        """Forget every reference held on the GPU and free that memory (spare and retired too) now, for
        a save whose budget shrank under it; returns the bytes freed. Those tensors are stored in
        full until the next background pass finds them memory within the new budget.

        Freed at once, not retired to the next pass: the memory came from PyTorch's caching allocator
        for the compressor stream, which orders its reuse after the copies still queued there (and
        a copy the compressor has in hand keeps its tensor alive), and the save asking for it is
        about to allocate its scratch on that stream."""
        freed = 0
        with self._lock:
            on_device = [key for key, memory in self._memory.items() if memory.block is None]
            for key in on_device:
                super()._drop(key)  # not self._drop: that would retire the memory, not free it
                freed += self._free_device(self._memory.pop(key))
            for key in [key for key, memory in self._spare.items() if memory.block is None]:
                freed += self._free_device(self._spare.pop(key))
            for memory in [memory for memory in self._retired if memory.block is None]:
                self._retired.remove(memory)
                freed += self._free_device(memory)
        return freed

    # ------------------------------------------------------------------ worker thread
    def commit(self, step: int, manifest_sha256: str, has_reference: bool) -> None:
        with self._lock:
            valid, frozen = self._valid_for == step, self._frozen
            super().commit(step, manifest_sha256, has_reference)
            if valid and not frozen:
                # Spare memory of a key this save did not record (it left the state, or changed dtype
                # after a failed save) or recorded as not to keep would be held for good: free it.
                for key in [k for k in self._spare if k not in self._touched or k in self._not_kept]:
                    self._retired.append(self._spare.pop(key))
        self._start_preparing()

    def reserve(self, sizes: dict[str, int]) -> threading.Thread | None:
        """Allocate spare memory for these keys now, in the background (``preallocate``): the first
        save then keeps its references and the second is already a delta. Returns the thread.

        Keys under ``min_record_bytes`` are left out: the compressor stores them raw and records no
        reference for them, so their memory would only be freed again after the first save."""
        with self._lock:
            self._wanted.update({key: n for key, n in sizes.items() if n >= self.min_record_bytes})
        self._start_preparing()
        return self._preparing

    def wait_prepared(self, timeout_seconds: float | None = None) -> bool:
        """Wait for the background allocation started by the last commit; True once none runs."""
        thread = self._preparing
        if thread is not None:
            thread.join(timeout_seconds)
            return not thread.is_alive()
        return True

    def close(self) -> None:
        """Free every byte the store holds. Once no save runs (the checkpointer is closing)."""
        self.wait_prepared()
        with self._lock:
            memories = [*self._memory.values(), *self._spare.values(), *self._retired]
            self._memory.clear()
            self._spare.clear()
            self._retired.clear()
            self._wanted.clear()
            super()._clear()
        for memory in memories:
            self._free(memory)

    # ------------------------------------------------------------------ background thread
    def _start_preparing(self) -> None:
        with self._lock:
            wanted, self._wanted = self._wanted, {}
            retired, self._retired = self._retired, []
        if not wanted and not retired:
            return

        def run() -> None:
            if previous is not None:
                previous.join()  # one pass at a time: the counters and budgets stay exact
            for gone in retired:
                self._free(gone)
            for key, nbytes in wanted.items():
                self._prepare(key, nbytes)

        with self._lock:  # reserve() (training thread) and commit() (worker) both start passes
            previous = self._preparing
            self._preparing = threading.Thread(target=run, name="asyncckpt-reference-memory", daemon=True)
            self._preparing.start()

    def _prepare(self, key: str, nbytes: int) -> None:
        """Background thread: spare memory for ``key``, unless it has memory of that size already."""
        with self._lock:
            if self._has_memory(key, nbytes):
                return
        memory = self._allocate(nbytes)
        if memory is None:
            log.debug("asyncckpt: no reference memory for %r (%d bytes): stored in full", key, nbytes)
            return
        with self._lock:
            if self._has_memory(key, nbytes):
                self._retired.append(memory)  # freed by the next pass, like all memory given up
                return
            stale = self._spare.pop(key, None)
            if stale is not None:
                self._retired.append(stale)  # a copy into it may still be queued: not freed now
            self._spare[key] = memory

    def _has_memory(self, key: str, nbytes: int) -> bool:
        held, spare = self._memory.get(key), self._spare.get(key)
        return any(m is not None and m.data.numel() == nbytes for m in (held, spare))

    def _allocate(self, nbytes: int) -> _Memory | None:
        """GPU memory within the device budget, else pinned host memory within the host budget."""
        with self._lock:
            if self.device_budget_bytes is None:
                self.device_budget_bytes = _free_device_bytes(self.device) // 4
            on_device = self.device_bytes + nbytes <= self.device_budget_bytes
            if on_device:
                self.device_bytes += nbytes  # counted before allocating, outside the lock
        if on_device:
            try:
                with torch.cuda.stream(self.stream):  # None: no stream to switch to (the CPU tests)
                    return _Memory(torch.empty(nbytes, dtype=torch.uint8, device=self.device), None)
            except Exception as exc:  # noqa: BLE001 - out of memory above all: training holds what the budget counted on
                with self._lock:
                    self.device_bytes -= nbytes
                log.debug("asyncckpt: no GPU memory for a %d-byte reference (%s): trying pinned host memory",
                          nbytes, exc)  # fmt: skip
        with self._lock:
            if self.host_bytes + nbytes > self.budget_bytes:
                return None
            self.host_bytes += nbytes
        try:
            block = allocate_block(nbytes, self.device if self.device.type == "cuda" else None, self.pin)
        except Exception as exc:  # noqa: BLE001 - above all MemoryError/OSError: the host cannot pin that much now
            with self._lock:
                self.host_bytes -= nbytes
            log.info("asyncckpt: no pinned memory for a %d-byte reference (%s): stored in full", nbytes, exc)
            return None
        return _Memory(block.data, block)

    def _free(self, memory: _Memory) -> None:
        if memory.block is None:
            with self._lock:
                self._free_device(memory)
            return
        nbytes = int(memory.data.numel())
        free_block(memory.block)
        with self._lock:
            self.host_bytes -= nbytes
        memory.data = torch.empty(0, dtype=torch.uint8)

    def _free_device(self, memory: _Memory) -> int:
        """Store lock held: drop GPU ``memory`` (back to the caching allocator) and its count; its bytes."""
        nbytes = int(memory.data.numel())
        self.device_bytes -= nbytes
        memory.data = torch.empty(0, dtype=torch.uint8)
        return nbytes

    # ------------------------------------------------------------------ any thread, store lock held
    def _drop(self, key: str) -> None:
        memory = self._memory.pop(key, None)
        super()._drop(key)
        if memory is not None:
            with self._lock:
                self._retired.append(memory)

    def _clear(self) -> None:
        """Forget every reference but keep its memory, as spare for the same key."""
        with self._lock:
            for key, memory in self._memory.items():
                stale = self._spare.pop(key, None)
                if stale is not None:
                    self._retired.append(stale)
                self._spare[key] = memory
            self._memory.clear()
            super()._clear()


def _free_device_bytes(device: torch.device) -> int:
    """Free memory on ``device`` now (0 for a CPU "device", or when the driver cannot say)."""
    if device.type != "cuda":
        return 0
    try:
        return int(torch.cuda.mem_get_info(device)[0])
    except RuntimeError:
        return 0
