"""The compressor's GPU memory, kept apart from training's so that a budget can count it.

PyTorch's caching allocator keeps freed blocks for reuse. The compressor's scratch (nvCOMP
outputs, byte planes, packed groups) would otherwise sit in the same cache as training's
activations, invisible to ``torch.cuda.mem_get_info``: the next save would see less memory free,
plan smaller, allocate blocks of new sizes, and see less still. So the compressor thread
allocates from a private :class:`torch.cuda.MemPool`, and :attr:`ScratchPool.cached_bytes` (the
pool's reserved segments, measured after every save) is added back to the free memory when the
next save's budget is read. Training's allocations never come from this pool, and the
compressor never takes training's cached blocks.

Where this PyTorch lacks ``MemPool``/``use_mem_pool``, allocations go to the shared cache and
``cached_bytes`` stays 0 (the budget then only sees driver-free memory).

Threads: :meth:`allocating` and :meth:`measure` on the compressor thread; :attr:`cached_bytes`
is read by the training thread (a plain int, replaced whole).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

log = logging.getLogger("asyncckpt")


class ScratchPool:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cached_bytes = 0
        """GPU bytes this pool held after the last save (reused by the next one)."""
        self._pool: Any = None
        if hasattr(torch.cuda, "MemPool") and hasattr(torch.cuda, "use_mem_pool"):
            try:
                self._pool = torch.cuda.MemPool()
            except (RuntimeError, TypeError) as exc:  # an allocator configuration that has no pools
                log.info("asyncckpt: compressor scratch shares PyTorch's cache: %s", exc)

    @contextlib.contextmanager
    def allocating(self) -> Iterator[None]:
        """Route this thread's CUDA allocations to the pool for the duration."""
        if self._pool is None:
            yield
            return
        with torch.cuda.use_mem_pool(self._pool, self.device):
            yield

    def measure(self) -> None:
        """Record the pool's reserved bytes. Compressor thread, between saves."""
        if self._pool is None:
            return
        try:
            segments = torch.cuda.memory_snapshot(self._pool.id)
        except (RuntimeError, TypeError):
            return
        self.cached_bytes = sum(int(seg.get("total_size", 0)) for seg in segments)
