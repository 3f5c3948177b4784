"""How fast compressed bytes can reach host memory that was not pinned before the save.

A ``fence`` save of a full GPU (issue 15) holds the next optimizer step until the whole state has
been read, and its compressed bytes leave bounded GPU scratch through PCIe into host staging.
When that staging is already pinned the drain runs at PCIe speed; on the first save it is not,
and pinning it there (fault the pages in, then ``cudaHostRegister``) held the fence for ~9 s for
28 GB. This measures the ways around that, each over ``--gib`` GiB:

* ``pin`` phases: ``mmap`` + fault-in (``zero_`` on torch's intra-op threads), then
  ``cudaHostRegister`` of the populated pages, timed apart;
* ``fault in``: the fault-in alone, by one ``mmap(MAP_POPULATE)`` and by N threads each
  ``madvise(MADV_POPULATE_WRITE)``-ing a slice (how fast can fresh memory be made present?);
* ``pin xN``: the same bytes as N blocks pinned by N threads at once (does registration scale?);
* ``bounce``: device-to-host copies into a small pinned ring (two ``--chunk-mib`` slots, the second
  filling while the first is copied out), each slot copied by the CPU into plain ``mmap`` memory
  that was never touched (``fresh``: the copy faults the pages in), then again into the same,
  now populated, memory (``warm``);
* ``direct``: device-to-host straight into pinned memory, the rate a warmed-up save drains at.

Usage (GPU): ``python -m benchmarks.host_staging --out DIR``; ``--tiny`` runs the host-side parts
on the CPU. Writes ``host-staging-<stamp>-<gpu>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import mmap
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from asyncckpt._gpu.pinned_pool import HOST_REGISTER_PORTABLE, allocate_block, free_block

from .common import describe_machine, fmt_bytes, report_head, result_name, write_report


def _timed(run: Callable[[], Any]) -> float:
    began = time.perf_counter()
    run()
    return time.perf_counter() - began


def pin_phases(nbytes: int, device: torch.device | None) -> dict[str, float]:
    """Seconds to map, fault in and register ``nbytes`` on one thread (registration skipped without CUDA)."""
    mapping = mmap.mmap(-1, nbytes)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE)
    data = torch.frombuffer(mapping, dtype=torch.uint8)
    fault = _timed(data.zero_)
    register = 0.0
    if device is not None:
        with torch.cuda.device(device):
            register = _timed(lambda: torch.cuda.cudart().cudaHostRegister(data.data_ptr(), nbytes,
                                                                            HOST_REGISTER_PORTABLE))  # fmt: skip
            torch.cuda.cudart().cudaHostUnregister(data.data_ptr())
    return {"fault_seconds": fault, "register_seconds": register}


MADV_POPULATE_WRITE = 23
"""Linux 5.14+: fault a range in, writable, in one call (no per-page trap)."""


def populate_parallel(nbytes: int, threads: int) -> float:
    """Seconds for ``threads`` threads to fault in one slice each of a fresh ``nbytes`` mapping with
    ``madvise(MADV_POPULATE_WRITE)`` (through ctypes, which lets go of the GIL)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    mapping = mmap.mmap(-1, nbytes)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    step = -(-nbytes // threads // mmap.PAGESIZE) * mmap.PAGESIZE
    errors: list[int] = []

    def one(offset: int) -> None:
        if libc.madvise(base + offset, min(step, nbytes - offset), MADV_POPULATE_WRITE) != 0:
            errors.append(ctypes.get_errno())

    def run() -> None:
        workers = [threading.Thread(target=one, args=(o,)) for o in range(0, nbytes, step)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()

    seconds = _timed(run)
    if errors:
        raise OSError(errors[0], f"madvise(MADV_POPULATE_WRITE) failed: {os.strerror(errors[0])}")
    return seconds


def map_populate(nbytes: int) -> float:
    """Seconds for one ``mmap(MAP_POPULATE)`` of ``nbytes`` (the kernel faults every page in the call)."""
    return _timed(lambda: mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE))


def transparent_huge_pages() -> dict[str, str]:
    """The kernel's THP settings (the fault-in rate depends on them); empty where not readable."""
    found = {}
    for name in ("enabled", "defrag"):
        with contextlib.suppress(OSError):
            found[name] = Path(f"/sys/kernel/mm/transparent_hugepage/{name}").read_text().strip()
    return found


def pin_parallel(nbytes: int, threads: int, device: torch.device | None) -> float:
    """Seconds for ``threads`` threads to allocate and pin ``nbytes / threads`` each, all at once."""
    blocks: list[Any] = []
    lock = threading.Lock()

    def one() -> None:
        block = allocate_block(nbytes // threads, device, pin=device is not None)
        with lock:
            blocks.append(block)

    def run() -> None:
        workers = [threading.Thread(target=one) for _ in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()

    seconds = _timed(run)
    for block in blocks:
        free_block(block)
    return seconds


def bounce(source: torch.Tensor, chunk: int, device: torch.device | None) -> dict[str, float]:
    """Seconds to move ``source`` into never-touched host memory through a two-slot pinned ring, then
    again into the same memory (now populated). The D2H of one slot overlaps the CPU copy of the other."""
    nbytes = int(source.numel())
    mapping = mmap.mmap(-1, nbytes)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE)
    destination = torch.frombuffer(mapping, dtype=torch.uint8)
    ring = [allocate_block(chunk, device, pin=device is not None) for _ in range(2)]
    stream = torch.cuda.Stream(device) if device is not None else None
    done = [torch.cuda.Event() if device is not None else None for _ in range(2)]

    def one_pass() -> None:
        pending: list[tuple[int, int, int]] = []  # (slot, offset, length) copied in, not yet out
        for i, offset in enumerate(range(0, nbytes, chunk)):
            slot, length = i % 2, min(chunk, nbytes - offset)
            if len(pending) == 2:
                drain(*pending.pop(0))
            if stream is not None:
                with torch.cuda.stream(stream):
                    ring[slot].data[:length].copy_(source[offset : offset + length], non_blocking=True)
                    done[slot].record(stream)  # type: ignore[union-attr]
            else:
                ring[slot].data[:length].copy_(source[offset : offset + length])
            pending.append((slot, offset, length))
        for item in pending:
            drain(*item)

    def drain(slot: int, offset: int, length: int) -> None:
        if done[slot] is not None:
            done[slot].synchronize()  # type: ignore[union-attr]
        destination[offset : offset + length].copy_(ring[slot].data[:length])  # torch's intra-op threads

    fresh, warm = _timed(one_pass), _timed(one_pass)
    assert torch.equal(destination[: min(nbytes, 1 << 20)], source[: min(nbytes, 1 << 20)].cpu())
    for block in ring:
        free_block(block)
    return {"fresh_seconds": fresh, "warm_seconds": warm}


def direct(source: torch.Tensor, device: torch.device) -> float:
    """Seconds for one device-to-host copy of ``source`` into already pinned memory."""
    block = allocate_block(int(source.numel()), device, pin=True)
    block.data.copy_(source, non_blocking=True)  # warm-up: first use of the mapping
    torch.cuda.synchronize(device)

    def run() -> None:
        block.data.copy_(source, non_blocking=True)
        torch.cuda.synchronize(device)

    seconds = _timed(run)
    free_block(block)
    return seconds


def measure(nbytes: int, chunk: int, thread_counts: Sequence[int], device: torch.device | None) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []

    def add(name: str, seconds: float) -> None:
        rows.append({"name": name, "seconds": seconds, "bytes_per_second": nbytes / seconds if seconds else None})
        print(f"{name}: {seconds:.3f} s, {fmt_bytes(nbytes / seconds if seconds else 0)}/s", file=sys.stderr)

    phases = pin_phases(nbytes, device)
    add("pin: fault in (zero_, intra-op threads)", phases["fault_seconds"])
    if device is not None:
        add("pin: cudaHostRegister (populated pages)", phases["register_seconds"])
    add("fault in: mmap(MAP_POPULATE), one call", map_populate(nbytes))
    for threads in thread_counts:
        add(f"fault in x{threads} (madvise POPULATE_WRITE on {threads} threads)", populate_parallel(nbytes, threads))
    for threads in thread_counts:
        add(f"pin x{threads} (allocate_block on {threads} threads)", pin_parallel(nbytes, threads, device))
    source = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device or "cpu")
    moved = bounce(source, chunk, device)
    add(f"bounce via 2 x {fmt_bytes(chunk)} pinned ring into fresh memory", moved["fresh_seconds"])
    add(f"bounce via 2 x {fmt_bytes(chunk)} pinned ring into populated memory", moved["warm_seconds"])
    if device is not None:
        add("direct D2H into pinned memory", direct(source, device))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=8.0, help="bytes moved per measurement, GiB")
    p.add_argument("--chunk-mib", type=int, default=256, help="pinned ring slot size, MiB")
    p.add_argument("--threads", default="1,4,8,16", help="thread counts for parallel pinning")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--tiny", action="store_true", help="64 MiB, host-side parts only (CPU smoke test)")
    args = p.parse_args(argv)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    nbytes = (64 << 20) if args.tiny else int(args.gib * (1 << 30))
    chunk = (8 << 20) if args.tiny else args.chunk_mib << 20
    threads = [int(t) for t in args.threads.split(",")]
    machine = describe_machine(args.out)
    rows = measure(nbytes, chunk, threads, device)
    head = report_head("python -m benchmarks.host_staging", sys.argv[1:] if argv is None else argv, machine)
    report = {**head, "bytes": nbytes, "chunk_bytes": chunk, "torch_threads": torch.get_num_threads(),
              "transparent_huge_pages": transparent_huge_pages(), "rows": rows}  # fmt: skip
    lines = [
        "# Host staging without pinning on the fence",
        "",
        f"{report['when']}, {machine.get('gpu') or 'CPU'}; {report['versions_line']}; {fmt_bytes(nbytes)} per row, "
        f"{torch.get_num_threads()} torch threads; transparent huge pages {report['transparent_huge_pages']}. "
        f"Command: `{report['command']}`.",
        "",
        "| what | seconds | rate |",
        "|---|---|---|",
        *(f"| {r['name']} | {r['seconds']:.3f} | {fmt_bytes(r['bytes_per_second'] or 0)}/s |" for r in rows),
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    write_report(args.out, result_name("host-staging", machine, args.tiny), report, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
