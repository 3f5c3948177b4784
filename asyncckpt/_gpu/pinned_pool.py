"""Pinned host blocks for compressed bytes that do not stay on the GPU, reused from save to save.

When a ``fence`` save's compressed state does not fit its GPU budget, the compressor copies each
compressed group to a pinned block (device-to-host at PCIe speed on its own copy stream) and the
writer writes it from there. Blocks are sized to the group they hold (rounded up, with a little
headroom so the next save's slightly different sizes fit), kept after the save and reused, so a
steady state pins nothing.

Pinning is the expensive part (faulting the pages in, then the driver locking them; seconds for
tens of GB), so it is never done on the training thread. :meth:`PinnedPool.reserve` pins ahead on
:data:`PIN_THREADS` background threads, each its own blocks: measured on an H100 host (16 cores,
``benchmarks/results/host-staging-20261206-184006-h10080gbhbm3.md``), 8 GiB pinned at 4.6 GB/s by one
thread and 15.5 GB/s by eight, where the fault-in of one mapping by many threads stayed at ~5-6 GB/s.
``AsyncCheckpointer.preallocate`` reserves before the first save; a save that starts while the
reservation runs has the compressor's :meth:`PinnedPool.acquire` wait for a reserved block that
fits rather than pin one of its own. A save that finds the pool short (a first save without
``preallocate``) reserves what it will spill a window ahead of its compressor (:meth:`PinnedPool.cover`,
asked by :class:`~asyncckpt._gpu.spill_reservation.SpillReservation`), each group estimated at its
raw bytes times the ratio its tensors' classes have shown so far: reserving raw sizes ahead was tried
(2026-12-06, H100) and cut a first save's fence from 8.7 s to 5.1 s, but held 36.4 GB of pinned
memory for 28.2 GB of compressed bytes (1.29x, where blocks sized to the compressed groups hold
1.08x), and the pool keeps what a save used.

Memory is allocated with ``mmap`` (page-aligned, with transparent huge pages advised, which
makes pinning cheaper) and registered with ``cudaHostRegister``: torch's own pinned allocator
rounds every block up to a power of two, which would cost up to twice the compressed state.
Without CUDA (``pin=False``) the blocks are plain memory, which is how the CPU tests run.

Threads: ``acquire`` on the compressor thread, ``give_back`` on the checkpoint worker thread,
``reserve`` starts threads of its own; every method takes the pool's lock.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import mmap
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .._alignment import align_up

log = logging.getLogger("asyncckpt")

BLOCK_ALIGN_BYTES = 2 << 20
"""Blocks are a whole number of 2 MiB huge pages."""
HEADROOM_DIVISOR = 16
"""A block is made 1/16 larger than asked, so the next save's groups, a little larger, still fit."""
TWIN_DIVISOR = 8
"""An unused block at most 1/8 larger than a used one replaces it when a save ends (a block's headroom
is 1/16 of its group, a reservation's margin for a known group 1/32)."""
HOST_REGISTER_PORTABLE = 1
"""``cudaHostRegisterPortable``: the memory counts as pinned in every CUDA context."""
PIN_THREADS = 8
"""Threads a reservation pins with (each block one thread's): 8 reached 15.5 GB/s of the 16.6 GB/s
that 16 did on a 16-core host; more would take cores from the training process's own threads."""


def block_size_for(nbytes: int) -> int:
    want = nbytes + nbytes // HEADROOM_DIVISOR
    return max(BLOCK_ALIGN_BYTES, align_up(want, BLOCK_ALIGN_BYTES))


@dataclass(eq=False)
class PinnedBlock:
    """One registered host allocation; ``data`` is its bytes (1-D uint8)."""

    data: torch.Tensor
    _mapping: mmap.mmap | None
    pinned: bool
    device: torch.device | None = None

    @property
    def nbytes(self) -> int:
        return int(self.data.numel())


class PinnedPool:
    """Pinned blocks up to ``budget_bytes`` in all; see the module docstring."""

    def __init__(self, budget_bytes: int, pin: bool | None = None, device: torch.device | None = None,
                 held_elsewhere: Callable[[], int] | None = None) -> None:  # fmt: skip
        """``held_elsewhere``: host staging bytes held outside the pool under the same budget (the
        raw host arena); ``device``: the GPU whose context registers the blocks."""
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.device = device
        self._held_elsewhere = held_elsewhere
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        """Notified when a block is given back or a reservation ends (what a waiting acquire wants)."""
        self._free: list[PinnedBlock] = []
        self._allocated_bytes = 0
        self.pinned_bytes_total = 0
        """Bytes pinned over the pool's life (a save that reuses blocks adds nothing)."""
        self._reserving: list[threading.Thread] = []
        self._pending: list[int] = []
        """Sizes reservations will still pin (taken by their threads one at a time)."""
        self._pinning = 0
        """Reservations running."""
        self._in_pin: list[int] = []
        """Sizes a reservation's thread is pinning now (no longer pending, not yet free)."""
        self._pin_workers = 0
        """Pinning threads alive (of every reservation): each takes pending sizes until none is left."""

    @property
    def allocated_bytes(self) -> int:
        """Host bytes the pool holds (free and in use)."""
        return self._allocated_bytes

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(b.nbytes for b in self._free)

    def acquire(self, nbytes: int) -> PinnedBlock | None:
        """A block of at least ``nbytes``: a free one that fits, else one a running reservation will
        pin that fits (waited for), else a new one; None if the budget is spent.

        Compressor thread. Pinning a new block takes time (about a second per few GB, on this one
        thread); that is why :meth:`reserve` exists.
        """
        with self._lock:
            while True:
                fitting = [b for b in self._free if nbytes <= b.nbytes]
                if fitting:
                    # Never pin while a fitting block is free: pinning holds the fence. An oversized
                    # block is given back by recycle() if a later save no longer needs it.
                    best = min(fitting, key=lambda b: b.nbytes)
                    self._free.remove(best)
                    return best
                # A block being pinned by several threads arrives sooner than one pinned here, and
                # pinning a second one would take the budget the reservation counted on.
                coming = (*self._pending, *self._in_pin)
                if not self._pinning or not any(nbytes <= block_size_for(size) for size in coming):
                    break
                self._arrived.wait()
        block = self._allocate_within_budget(nbytes)
        if block is None and self._free_too_small(nbytes):
            block = self._allocate_within_budget(nbytes)
        return block

    def _free_too_small(self, nbytes: int) -> bool:
        """Free blocks (none of which fits ``nbytes``: acquire found none) until a block for ``nbytes``
        fits the budget, largest first; whether any was freed. A reservation sized to an estimate
        that proved low would otherwise hold the budget with blocks no group fits, and the save
        would go on paced by the disk where pinning its own blocks had fitted."""
        elsewhere = self._held_elsewhere() if self._held_elsewhere is not None else 0
        with self._lock:
            over = self._allocated_bytes + elsewhere + nbytes - self.budget_bytes
            free_bytes = sum(b.nbytes for b in self._free)
            if over > free_bytes:
                return False  # blocks in use hold the rest: freeing these would not make room
            freed = self._take_largest_free(free_bytes - over)
        for block in freed:
            free_block(block)
        return bool(freed)

    def _allocate_within_budget(self, nbytes: int) -> PinnedBlock | None:
        elsewhere = self._held_elsewhere() if self._held_elsewhere is not None else 0
        with self._lock:
            size = block_size_for(nbytes)
            if self._allocated_bytes + elsewhere + size > self.budget_bytes:
                size = nbytes  # no headroom when the budget is tight
                if self._allocated_bytes + elsewhere + size > self.budget_bytes:
                    return None
            self._allocated_bytes += size  # counted before pinning, outside the lock
            self.pinned_bytes_total += size
        try:
            return self._allocate(size)
        except BaseException:
            with self._lock:
                self._allocated_bytes -= size
            raise

    def give_back(self, blocks: Sequence[PinnedBlock]) -> None:
        """Return blocks for reuse. Worker thread, once nothing reads them any more."""
        with self._lock:
            self._free.extend(blocks)
            self._arrived.notify_all()

    def recycle(self, blocks: Sequence[PinnedBlock]) -> int:
        """Give back the blocks a save used and free every other free block; returns the bytes freed.

        Worker thread, at the end of a save. What the pool keeps is then what the last save
        needed (a reservation larger than that, or blocks of an older, larger state, are freed),
        which bounds pinned memory to about one compressed state per save in flight; an unused
        block a little larger than a used one is kept in its place (:func:`_keep_larger_twins`)."""
        with self._lock:
            if self._pinning:  # the free blocks may be a reservation's for the next save: keep them
                self._free.extend(blocks)
                self._arrived.notify_all()
                return 0
            # The save's blocks were in use, not free: those free now are the ones it did not use.
            stale, self._free = _keep_larger_twins(self._free, list(blocks))
            freed_bytes = sum(b.nbytes for b in stale)
            self._allocated_bytes -= freed_bytes
            self._arrived.notify_all()
        for block in stale:
            free_block(block)
        return freed_bytes

    def reserve(self, sizes: Sequence[int], threads: int = PIN_THREADS, front: bool = False) -> threading.Thread:
        """Pin free blocks of ``sizes`` bytes, in that order, on up to ``threads`` background threads
        (within the budget; all reservations together use at most ``threads``); returns a thread that
        ends once nothing is left to pin (these sizes and any other reservation's). ``front``: ahead
        of the sizes already queued (a block the compressor is waiting for).

        Each block is usable as soon as it is pinned, by a save that started before the rest were."""
        with self._lock:
            if front:
                self._pending[0:0] = sizes
            else:
                self._pending.extend(sizes)
            self._pinning += 1
            # Threads already pinning take these sizes too (they stop only when nothing is
            # pending, a check made under this lock): a save that reserves group by group
            # (cover) keeps at most `threads` pinning, not `threads` per call.
            spawn = max(0, min(threads - self._pin_workers, len(sizes)))
            self._pin_workers += spawn

        def pin_next() -> None:
            while True:
                with self._lock:
                    if not self._pending:
                        self._pin_workers -= 1
                        self._arrived.notify_all()  # a reservation waiting on this thread's sizes
                        return
                    size = self._pending.pop(0)
                    self._in_pin.append(size)
                block = None
                try:
                    block = self._allocate_within_budget(size)  # a new block each: free ones may be in use soon
                finally:
                    with self._lock:  # one step from pinning to free: a waiting acquire never sees neither
                        self._in_pin.remove(size)
                        if block is not None:
                            self._free.append(block)
                        else:  # the budget is spent (or the pin failed): this thread ends here
                            self._pending.clear()  # a waiting acquire goes on at once, the other threads stop
                            self._pin_workers -= 1
                        self._arrived.notify_all()
                if block is None:
                    log.info("asyncckpt: pinned staging reservation stopped at the host budget (%d bytes)",
                             self.budget_bytes)  # fmt: skip
                    return

        def pin_logged() -> None:
            try:
                pin_next()
            except Exception:  # a failed pin ends this thread's share; acquire() pins what is missing itself
                log.warning("asyncckpt: pinning staging memory ahead failed", exc_info=True)

        def run() -> None:
            workers: list[threading.Thread] = []
            try:
                for _ in range(spawn):
                    worker = threading.Thread(target=pin_logged, name="asyncckpt-pin", daemon=True)
                    worker.start()
                    workers.append(worker)
            finally:
                for worker in workers:
                    worker.join()
                with self._lock:
                    self._pin_workers -= spawn - len(workers)  # counted above but never started
                    # Sizes other reservations' threads took: this thread still ends only once every
                    # size asked for has been pinned (or no thread is left to pin it).
                    while (self._pending or self._in_pin) and self._pin_workers:
                        self._arrived.wait()
                    self._end_reservation()

        thread = threading.Thread(target=run, name="asyncckpt-reserve", daemon=True)
        try:
            thread.start()  # before it is listed: a thread not yet started is not alive, and would be pruned
        except BaseException:
            # Undo what run() would have: counted workers that will never exist would leave every
            # later reservation without threads, and acquire() waiting for sizes nobody pins.
            with self._lock:
                self._pin_workers -= spawn
                self._end_reservation()
            raise
        with self._lock:
            self._reserving = [t for t in self._reserving if t.is_alive()]
            self._reserving.append(thread)
        return thread

    def _end_reservation(self) -> None:
        """One reservation less; with none left, sizes no thread will pin are dropped, so acquire()
        is never left waiting for them. Under the lock."""
        self._pinning -= 1
        if not self._pinning:
            self._pending.clear()
        self._arrived.notify_all()

    def cover(self, sizes: Sequence[int], estimated_from: int | None = None,
              least_blocks: Sequence[int] | None = None) -> threading.Thread | None:  # fmt: skip
        """Reserve blocks for those of ``sizes`` (in the order they will be asked for) that the free
        blocks and the blocks reservations are pinning do not cover; the last reservation's thread,
        or None when nothing is missing. Each block covers one size it fits, largest sizes first;
        the missing ones are pinned in the order given.

        ``estimated_from``: the sizes from this index on are estimates (of groups not yet
        compressed), covered only by a block with the headroom a new one would get
        (:func:`block_size_for`), since the group may come out a little larger, or by a block of
        ``least_blocks[k]`` bytes for the k-th estimate where given (an estimate known to be close);
        the sizes before it are exact (resolved groups, waiting for their blocks), and those missing
        are pinned ahead of everything pending. A missing estimate is pinned with a new block's
        headroom either way. The compressor's calls during a ``fence`` save
        (:class:`~asyncckpt._gpu.spill_reservation.SpillReservation`) pin what is ahead of it on
        :data:`PIN_THREADS` threads beside it."""
        exact = len(sizes) if estimated_from is None else estimated_from
        urgent = estimated_from is not None
        with self._lock:
            have = sorted([(b.nbytes, True) for b in self._free]
                          + [(block_size_for(n), False) for n in (*self._pending, *self._in_pin)])  # fmt: skip
        # Each size takes the smallest block that fits it, largest sizes first; exact sizes (wanted
        # now) before estimates. A resolved group's size is not covered by a block still to be
        # pinned for a much larger one: acquire would wait for it behind the queue, and take it
        # from the tensor it was meant for.
        if least_blocks is not None and len(least_blocks) != len(sizes) - exact:
            raise ValueError(f"least_blocks has {len(least_blocks)} sizes for {len(sizes) - exact} estimates")
        least = list(least_blocks) if least_blocks is not None else [block_size_for(n) for n in sizes[exact:]]
        wants = sorted(((i < exact, size if i < exact else least[i - exact], i) for i, size in enumerate(sizes)),
                       reverse=True)  # fmt: skip
        missing: set[int] = set()
        for resolved, want, i in wants:
            cap = 2 * block_size_for(want) if resolved and urgent else None
            fits = (k for k, (n, free) in enumerate(have) if want <= n and (free or cap is None or n <= cap))
            k = next(fits, None)  # the smallest that fits
            if k is None:
                missing.add(i)
            else:
                have.pop(k)
        # In the order they will be asked for: acquire takes the first block that fits, so a
        # large block pinned first would go to a small early group and leave a large one without.
        now = [sizes[i] for i in sorted(missing) if i < exact]
        later = [sizes[i] for i in sorted(missing) if i >= exact]
        thread = None
        if now:
            thread = self.reserve(now, front=urgent)
        if later:
            thread = self.reserve(later)
        return thread

    @property
    def reserving(self) -> bool:
        """Whether a reservation is still pinning."""
        with self._lock:
            return self._pinning > 0

    def trim(self, keep_bytes: int) -> int:
        """Free unused blocks, largest first, until at most ``keep_bytes`` are free; returns bytes freed."""
        with self._lock:
            freed = self._take_largest_free(keep_bytes)
        freed_bytes = sum(b.nbytes for b in freed)  # before free_block empties them
        for block in freed:
            free_block(block)
        return freed_bytes

    def _take_largest_free(self, keep_bytes: int) -> list[PinnedBlock]:
        """Lock held: take free blocks, largest first, until at most ``keep_bytes`` are free, and
        stop counting them; the caller frees them outside the lock."""
        taken: list[PinnedBlock] = []
        self._free.sort(key=lambda b: b.nbytes)
        while self._free and sum(b.nbytes for b in self._free) > keep_bytes:
            taken.append(self._free.pop())
        self._allocated_bytes -= sum(b.nbytes for b in taken)
        return taken

    def close(self) -> None:
        """Free every free block; blocks still in use are freed by whoever holds them last."""
        with self._lock:
            self._pending.clear()  # what is not pinned yet never will be
            reserving = list(self._reserving)
        for thread in reserving:
            thread.join()
        self.trim(0)

    def _allocate(self, size: int) -> PinnedBlock:
        return allocate_block(size, self.device, self.pin)


def _keep_larger_twins(unused: list[PinnedBlock],
                       used: list[PinnedBlock]) -> tuple[list[PinnedBlock], list[PinnedBlock]]:  # fmt: skip
    """(the blocks to free, the blocks to keep) at the end of a save: the blocks it used are kept and
    the unused ones freed, except that an unused block up to 1/:data:`TWIN_DIVISOR` larger than a
    used one is kept in its place. A reservation pins a larger block where a free one fits a group
    with too little margin (``PinnedPool.cover``), but the group, arriving, takes the smallest block
    that fits; without the swap the larger block was freed at every save's end and pinned again
    at the next (0.79 GB a save in ``benchmarks/results/repin-20261207-cpu.py.txt``)."""
    kept = list(used)
    # The used blocks not yet replaced (indices into kept), smallest first; `sizes` are theirs.
    replaceable = sorted(range(len(kept)), key=lambda i: kept[i].nbytes)
    sizes = [kept[i].nbytes for i in replaceable]
    stale: list[PinnedBlock] = []
    for block in sorted(unused, key=lambda b: b.nbytes, reverse=True):
        k = bisect.bisect_left(sizes, block.nbytes) - 1  # the largest used block smaller than this one
        if k >= 0 and block.nbytes <= sizes[k] + sizes[k] // TWIN_DIVISOR:
            i = replaceable.pop(k)
            sizes.pop(k)
            stale.append(kept[i])
            kept[i] = block
        else:
            stale.append(block)
    return stale, kept


def allocate_block(size: int, device: torch.device | None, pin: bool) -> PinnedBlock:
    """``size`` bytes of page-aligned host memory, registered with CUDA on ``device`` when ``pin``.

    Calling thread; seconds for tens of GB (the driver locks every page), so never the training
    thread's, and never while a fence holds training. Free it with :func:`free_block`.
    """
    if size <= 0:
        return PinnedBlock(data=torch.empty(0, dtype=torch.uint8), _mapping=None, pinned=False, device=device)
    mapping = mmap.mmap(-1, size)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # THP disabled on this kernel: pinning is slower, nothing else changes
            mapping.madvise(mmap.MADV_HUGEPAGE)
    data = torch.frombuffer(mapping, dtype=torch.uint8)
    # Fault the pages in with torch's intra-op threads (many cores at once); registering
    # pages that are already there is what the driver does fastest.
    data.zero_()
    if pin:
        # On the block's device (the calling thread's current device may be another GPU's, or
        # unset: a context would be made on GPU 0); portable, so any context may copy into it.
        with torch.cuda.device(device):
            status = torch.cuda.cudart().cudaHostRegister(data.data_ptr(), size, HOST_REGISTER_PORTABLE)
        if int(status) != 0:
            raise MemoryError(f"cudaHostRegister of {size} bytes failed (CUDA error {int(status)})")
    return PinnedBlock(data=data, _mapping=mapping, pinned=pin, device=device)


def free_block(block: PinnedBlock) -> None:
    """Unregister ``block`` (if pinned) and drop this reference to its memory. Not while a copy uses it."""
    if block.pinned:
        with torch.cuda.device(block.device):
            torch.cuda.cudart().cudaHostUnregister(block.data.data_ptr())
        block.pinned = False
    # The mapping is unmapped once the last view of `data` (which holds the mmap object) is gone.
    block.data = torch.empty(0, dtype=torch.uint8)
    block._mapping = None
