"""Per-tensor codec choice for ``codec="auto"`` on the GPU, remembered per key.

The first time a key is saved (and every ``reprobe_every`` saves after that, because training
state drifts: Adam moments start at zero), every cheap candidate of its dtype encodes the whole
tensor and the smallest output is kept and written — so a probe costs extra GPU time but never
a second encode. Between probes only the remembered spec runs. For an explicit codec name the
choice is fixed: ``spec_for(codec, dtype)``.

Used by whichever thread compresses (the compressor thread, or a caller of ``encode()``); the
memory is shared, so it is guarded by a lock.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from .specs import CodecSpec, auto_candidates, spec_for

DEFAULT_REPROBE_EVERY = 16


@dataclass
class _Choice:
    spec: CodecSpec
    uses_left: int


class CodecChooser:
    def __init__(self, codec: str, reprobe_every: int = DEFAULT_REPROBE_EVERY) -> None:
        if codec not in ("auto", "none"):
            spec_for(codec, torch.float32)  # rejects names that are not nvCOMP codecs
        if reprobe_every < 1:
            raise ValueError(f"reprobe_every must be >= 1, got {reprobe_every}")
        self.codec = codec
        self.reprobe_every = reprobe_every
        self._memory: dict[tuple[str, torch.dtype], _Choice] = {}
        self._lock = threading.Lock()

    def specs_for(self, key: str, dtype: torch.dtype) -> tuple[CodecSpec, ...]:
        """The specs to encode this tensor with now: one, every candidate when probing, none for ``none``."""
        if self.codec == "none":
            return ()
        if self.codec != "auto":
            return (spec_for(self.codec, dtype),)
        with self._lock:
            choice = self._memory.get((key, dtype))
            if choice is not None and choice.uses_left > 0:
                choice.uses_left -= 1
                return (choice.spec,)
        return auto_candidates(dtype)

    def spec_without_probe(self, key: str, dtype: torch.dtype) -> tuple[CodecSpec, ...]:
        """At most one spec, using up none of a remembered choice's uses: the remembered spec, else
        ``auto``'s first guess. For retries after GPU memory ran short, where a probe (every
        candidate's output at once) is what does not fit."""
        if self.codec == "auto":
            with self._lock:
                choice = self._memory.get((key, dtype))
            return (choice.spec,) if choice is not None else auto_candidates(dtype)[:1]
        return self.specs_for(key, dtype)

    def chose(self, key: str, dtype: torch.dtype, spec: CodecSpec) -> None:
        """Remember the spec a probe picked for ``key``."""
        if self.codec == "auto":
            with self._lock:
                self._memory[(key, dtype)] = _Choice(spec, self.reprobe_every - 1)

    def remembered(self) -> dict[str, CodecSpec]:
        """What auto currently uses per key (for reports and tests)."""
        with self._lock:
            return {key: choice.spec for (key, _), choice in self._memory.items()}
