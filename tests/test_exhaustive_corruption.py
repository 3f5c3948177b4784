"""Every single-bit flip and every truncation of every file of a small checkpoint: detected or harmless.

For each corrupted copy, :func:`asyncckpt.load` must return the original state bit for bit, or
both ``load`` and :func:`asyncckpt.verify` must raise CorruptCheckpointError. Anything else (a
silently different state, another exception, or verify passing what load refuses) fails the
test. The counts are printed, recorded as JUnit properties, and written to
``$ASYNCCKPT_CORRUPTION_COUNTS`` (JSON) when set.

Runs in-process, flipping a byte in place with ``pwrite`` and flipping it back, so each case
costs one load, and one verify when load refuses it (about a millisecond in all). The small
checkpoint takes every bit of a manifest of a few KiB and of a data file of one blob; the
two-blob one adds the 4 KiB of alignment padding between blobs (about 20 s).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from property_states import difference

import asyncckpt
from asyncckpt._manifest import MANIFEST_NAME


def _small_state() -> dict[str, Any]:
    return {
        "model": {"w": torch.zeros(64), "empty": torch.empty(0, 2)},  # zstd-coded; an empty blob past the end
        "step": 3, "lr": 0.5, "name": "x", "flags": [True, None, b"\x01", float("nan")],
    }  # fmt: skip


def _two_blob_state() -> dict[str, Any]:
    state = _small_state()
    state["model"]["b"] = torch.arange(8, dtype=torch.int8)  # incompressible: stored raw at offset 4096
    return state


def _outcome(checkpoint: Path, original: Any) -> str:
    """``harmless``, ``detected``, or what went wrong."""
    try:
        loaded = asyncckpt.load(checkpoint)
    except asyncckpt.CorruptCheckpointError:
        pass
    except Exception as exc:  # noqa: BLE001 - every other outcome is a finding, reported by name
        return f"load raised {type(exc).__name__}: {exc}"
    else:
        found = difference(original, loaded)
        # Loaded bit for bit: harmless, whatever verify says (it may refuse a flip load never reads).
        return "harmless" if found is None else f"SILENT DIFFERENCE: {found}"
    try:
        asyncckpt.verify(checkpoint)
    except asyncckpt.CorruptCheckpointError:
        return "detected"
    except Exception as exc:  # noqa: BLE001
        return f"verify raised {type(exc).__name__}: {exc}"
    return "verify passes what load refuses"


@contextmanager
def _flipped(path: Path, offset: int, bit: int) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR)
    try:
        byte = os.pread(fd, 1, offset)[0]
        os.pwrite(fd, bytes([byte ^ (1 << bit)]), offset)
        try:
            yield
        finally:
            os.pwrite(fd, bytes([byte]), offset)
    finally:
        os.close(fd)


def _exhaust(checkpoint: Path, original: Any) -> dict[str, Counter[str]]:
    """Outcome counts per file: every bit flip, then every truncation."""
    results: dict[str, Counter[str]] = {}
    examples: dict[str, str] = {}
    for name in sorted(os.listdir(checkpoint)):
        path = checkpoint / name
        content = path.read_bytes()
        counts = results[name] = Counter()
        for offset in range(len(content)):
            for bit in range(8):
                with _flipped(path, offset, bit):
                    outcome = _outcome(checkpoint, original)
                counts[f"flip {outcome}"] += 1
                examples.setdefault(outcome, f"{name} byte {offset} bit {bit}")
        for length in range(len(content)):
            os.truncate(path, length)
            outcome = _outcome(checkpoint, original)
            counts[f"truncate {outcome}"] += 1
            examples.setdefault(outcome, f"{name} truncated to {length} bytes")
        path.write_bytes(content)
    bad = {outcome: where for outcome, where in examples.items() if not outcome.startswith(("detected", "harmless"))}
    assert not bad, f"undetected or mishandled corruption, first case of each: {bad}"
    return results


def _report(label: str, results: dict[str, Counter[str]], record: Callable[[str, object], None]) -> None:
    """Print the counts (seen with ``pytest -s``), attach them to the JUnit report, and write them to
    ``$ASYNCCKPT_CORRUPTION_COUNTS`` when set."""
    record(label, {name: dict(counts) for name, counts in results.items()})
    print(f"\n{label}:")
    for name, counts in results.items():
        print(f"  {name}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    target = os.environ.get("ASYNCCKPT_CORRUPTION_COUNTS")
    if target:
        previous = json.loads(Path(target).read_text()) if Path(target).exists() else {}
        previous[label] = {name: dict(counts) for name, counts in results.items()}
        Path(target).write_text(json.dumps(previous, indent=1, sort_keys=True))


def _checkpoint(run_dir: Path, state: dict[str, Any]) -> Path:
    with asyncckpt.AsyncCheckpointer(run_dir, codec="zstd") as ckpt:
        path = ckpt.save(1, state).result().path
    assert path is not None
    assert difference(state, asyncckpt.load(path)) is None
    return path


def test_every_flip_and_truncation_of_a_small_checkpoint_is_detected_or_harmless(
    run_dir: Path, record_property: Callable[[str, object], None]
) -> None:
    state = _small_state()
    path = _checkpoint(run_dir, state)
    assert (path / "data-0.bin").stat().st_size < 64 and (path / MANIFEST_NAME).stat().st_size < 4096
    results = _exhaust(path, state)
    _report("small checkpoint", results, record_property)
    manifest = results[MANIFEST_NAME]
    flips = 8 * (path / MANIFEST_NAME).stat().st_size
    assert manifest["flip detected"] == flips, "every bit of a sealed manifest is covered by its digest"


def test_every_flip_and_truncation_of_a_two_blob_checkpoint_is_detected_or_harmless(
    run_dir: Path, record_property: Callable[[str, object], None]
) -> None:
    state = _two_blob_state()
    path = _checkpoint(run_dir, state)
    results = _exhaust(path, state)
    _report("two-blob checkpoint", results, record_property)
    data = results["data-0.bin"]
    assert data["flip harmless"] == 8 * (
        4096 - json.loads((path / MANIFEST_NAME).read_bytes())["tensors"][0]["stored_bytes"]
    )
