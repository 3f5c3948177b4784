"""A one-line progress bar on stderr, drawn only when stderr is a terminal.

Long ``verify`` and ``convert`` runs (and the stall benchmark) show how far they are; a pipe, a
log file or a test harness sees nothing. No dependency: the bar is a carriage-return line.
:class:`Progress` runs on the calling thread; :class:`ReadProgress` draws from its own thread.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

_WIDTH = 24  # characters of the bar itself


class Progress:
    """Progress through ``total`` units (bytes when ``unit`` is "B", else counted items).

    ``enabled``: None draws when ``stream`` (default stderr) is a terminal. Redraws at most every
    ``interval_seconds``; :meth:`close` draws the final state and ends the line.
    """

    def __init__(self, what: str, total: int, *, unit: str = "B", stream: TextIO | None = None,
                 enabled: bool | None = None, interval_seconds: float = 0.1) -> None:  # fmt: skip
        self.what, self.total, self.unit = what, max(int(total), 0), unit
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = _is_terminal(self.stream) if enabled is None else enabled
        self.interval_seconds = interval_seconds
        self.done = 0
        self._began = time.monotonic()
        self._drawn = 0.0
        self._closed = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def advance(self, amount: int) -> None:
        self.done += amount
        now = time.monotonic()
        if self.enabled and now - self._drawn >= self.interval_seconds:
            self._drawn = now
            self._draw(now)

    def clear(self) -> None:
        """Erase the bar's line, so other output can be printed; :meth:`redraw` puts the bar back below it."""
        if self.enabled and not self._closed:
            self.stream.write("\r\033[K")
            self.stream.flush()

    def redraw(self) -> None:
        if self.enabled and not self._closed:
            self._draw(time.monotonic())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.enabled:
            self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self, now: float) -> None:
        fraction = min(self.done / self.total, 1.0) if self.total else 1.0
        filled = int(fraction * _WIDTH)
        seconds = max(now - self._began, 1e-9)
        if self.unit == "B":
            amount = f"{self.done / 1e6:.1f}/{self.total / 1e6:.1f} MB, {self.done / 1e6 / seconds:.0f} MB/s"
        else:
            amount = f"{self.done}/{self.total} {self.unit}"
        bar = "#" * filled + "." * (_WIDTH - filled)
        self.stream.write(f"\r{self.what}: {fraction * 100:3.0f}% [{bar}] {amount}, {seconds:.1f} s ")
        self.stream.flush()


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a replaced or closed stream
        return False


class ReadProgress:
    """A bar for a library call that reads ``total_bytes`` from disk (``verify``, ``load``) and reports nothing.

    The call runs unchanged on the calling thread; while it does, a daemon thread samples the bytes
    this process has read (``rchar`` in ``/proc/self/io``: every ``read``/``pread`` syscall, which is
    how POSIX and KvikIO compat-mode reads reach the disk) and draws them against ``total_bytes``.
    ``counter="wchar"`` follows writes instead (``convert``'s output). Without ``/proc`` (not Linux)
    or without a terminal there is no thread and no bar.
    """

    def __init__(self, what: str, total_bytes: int, *, counter: str = "rchar", stream: TextIO | None = None,
                 enabled: bool | None = None) -> None:  # fmt: skip
        self.bar = Progress(what, total_bytes, stream=stream, enabled=enabled)
        self.counter = counter
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> ReadProgress:
        start = _io_bytes(self.counter)
        if self.bar.enabled and start is not None:
            self._thread = threading.Thread(target=self._sample, args=(start,), name="asyncckpt-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if exc[0] is None:
            self.bar.advance(self.bar.total - self.bar.done)  # done: the bar ends full
        self.bar.close()

    def _sample(self, start: int) -> None:
        while not self._stop.wait(self.bar.interval_seconds):
            now = _io_bytes(self.counter)
            if now is None:
                return
            self.bar.advance(min(now - start, self.bar.total) - self.bar.done)


def _io_bytes(counter: str) -> int | None:
    """This process' ``rchar`` (bytes read) or ``wchar`` (bytes written) so far; None without ``/proc``."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith(f"{counter}:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None
