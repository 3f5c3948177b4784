"""Fences for ``snapshot="fence"``: the next optimizer step waits on a CUDA event, on the GPU.

In ``fence`` mode nothing is copied: the compressor reads the live tensors on its own stream.
The state must not change until it has read them, and in a training loop the state changes
in ``optimizer.step()``. So ``save()`` arms a :class:`FenceGate`, and a global optimizer step
pre-hook (installed once per process) makes the step's stream wait for the gate's event —
``stream.wait_event``, a GPU-side wait: the host thread goes on queueing kernels.

The one host wait: a gate is *opened* once the compressor thread has queued every kernel
that reads the live tensors and recorded the event after them (an event not yet recorded
would order nothing). That takes the compressor a few milliseconds after ``save()``, usually
hidden behind the next forward/backward; :attr:`FenceGate.host_wait_seconds` reports it.

Only ``optimizer.step()`` is fenced. Code that mutates saved tensors in place some other way
must first wait for ``handle.wait_staged()``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

_pending: list[FenceGate] = []
_lock = threading.Lock()
_hook: Any = None
_host_wait_seconds_total = 0.0


class FenceGate:
    """The fence of one save. Opened or failed by the compressor thread; waited on by the training thread."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.done: torch.cuda.Event | None = None
        self.host_wait_seconds = 0.0
        """Host seconds the training thread waited for the gate to open (in the step pre-hook)."""
        self._opened = threading.Event()
        self._staged = threading.Event()
        self._callbacks: list[Callable[[], None]] = []
        self._stall: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        self._cb_lock = threading.Lock()

    # compressor thread
    def open(self, done: torch.cuda.Event) -> None:
        """Every kernel that reads the live tensors is queued before ``done`` (recorded on the compressor stream)."""
        self.done = done
        self._opened.set()

    def fail(self) -> None:
        """Compression will not read the live tensors (it failed or was cancelled): do not hold training."""
        self._opened.set()
        self.mark_staged()

    def mark_staged(self) -> None:
        """The compressor has finished reading the live tensors: they may be mutated by any means."""
        with self._cb_lock:
            self._staged.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()

    def when_staged(self, callback: Callable[[], None]) -> None:
        with self._cb_lock:
            if not self._staged.is_set():
                self._callbacks.append(callback)
                return
        callback()

    # training thread
    def hold_current_stream(self) -> None:
        global _host_wait_seconds_total
        began = time.perf_counter()
        self._opened.wait()
        waited = time.perf_counter() - began
        self.host_wait_seconds += waited
        _host_wait_seconds_total += waited  # one training thread holds fences: no lock needed
        if self.done is None:
            return
        stream = torch.cuda.current_stream(self.device)
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record(stream)
        stream.wait_event(self.done)
        after.record(stream)
        self._stall = (before, after)

    def gpu_wait_seconds(self) -> float:
        """GPU time the training stream spent waiting on this fence (0 if no step has run since)."""
        if self._stall is None:
            return 0.0
        before, after = self._stall
        after.synchronize()
        return before.elapsed_time(after) / 1e3


def arm(gate: FenceGate) -> None:
    """Make the next ``optimizer.step()`` of any optimizer wait for ``gate``. Training thread."""
    global _hook
    with _lock:
        _pending.append(gate)
        if _hook is None:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            _hook = register_optimizer_step_pre_hook(_before_step)


def hold_all() -> None:
    """Wait (on the GPU) for every armed fence; what the step pre-hook does. Training thread."""
    with _lock:
        gates = list(_pending)
        _pending.clear()
    for gate in gates:
        gate.hold_current_stream()


def _before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    if _pending:  # unlocked peek: the common no-fence step costs one list check
        hold_all()


def host_wait_seconds_total() -> float:
    """Host seconds training threads of this process have spent waiting for fences to open."""
    return _host_wait_seconds_total
