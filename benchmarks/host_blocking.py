"""What the GPU pipeline's library calls cost the *host*, and what background checkpoint work costs training.

A diagnostic for the two GPU-pipeline figures that depend on host behaviour (steps slower while
a checkpoint persists; nvCOMP throughput in the pipeline), run on the lent H200:

1. **Blocking probes.** A ``torch.cuda._sleep`` kernel (~``--sleep-ms``) is queued first, on the
   calling stream or on another stream, then each call is timed on the host, while a
   background Python thread counts how often it gets the GIL. A call that takes about the
   sleep waits for the GPU; one during which the counter stands still holds the GIL.
2. **Interference.** Training steps of the benchmark workload are timed with nothing else
   running, then with each background activity alone on another thread (KvikIO writes of
   device memory, the checksum kernel, batched nvCOMP encodes, a Python busy loop, and the
   allocations of reference memory: host pages faulted, pinned, registered, device blocks).

Usage (device only): ``python3 -m benchmarks.host_blocking --out DIR [--only reference --no-probes]``; writes
``host-blocking-<stamp>-<gpu>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from .common import (
    Progress,
    Workload,
    WorkloadConfig,
    describe_machine,
    result_name,
    utc_stamp,
    versions,
    write_json,
    write_report,
)


class GilCounter:
    """A background thread that increments a counter whenever it holds the GIL (sleeping 50 us between)."""

    def __init__(self) -> None:
        self.count = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.count += 1
            time.sleep(0.00005)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def _cycles_per_ms(stream: torch.cuda.Stream) -> float:
    with torch.cuda.stream(stream):
        began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        began.record()
        torch.cuda._sleep(10_000_000)
        ended.record()
    ended.synchronize()
    return 10_000_000 / began.elapsed_time(ended)


def probe(name: str, call: Callable[[], Any], sleep_on: torch.cuda.Stream | None, cycles: int,
          counter: GilCounter) -> dict[str, Any]:  # fmt: skip
    """Host seconds of ``call`` with a sleep kernel queued on ``sleep_on`` first, and GIL ticks seen meanwhile."""
    torch.cuda.synchronize()
    if sleep_on is not None:
        with torch.cuda.stream(sleep_on):
            torch.cuda._sleep(cycles)
    ticks = counter.count
    began = time.perf_counter()
    call()
    seconds = time.perf_counter() - began
    ticks = counter.count - ticks
    torch.cuda.synchronize()
    return {"call": name, "host_seconds": seconds, "gil_ticks_per_ms": ticks / max(seconds * 1e3, 1e-9)}


def blocking_probes(sleep_ms: float, progress: Progress) -> list[dict[str, Any]]:
    from nvidia import nvcomp

    from asyncckpt._gpu import batch, kernels
    from asyncckpt._gpu.deps import kvikio
    from asyncckpt._gpu.specs import CodecSpec

    device = torch.device("cuda")
    own, other = torch.cuda.Stream(), torch.cuda.Stream()
    cycles = int(_cycles_per_ms(own) * sleep_ms)
    counter = GilCounter()
    data = torch.randn(64 << 20, device=device).view(torch.uint8)  # 256 MiB
    chunk = 1 << 20
    offsets = list(range(0, data.numel(), chunk))
    sizes = [chunk] * len(offsets)
    spec = CodecSpec("ans", data_type="<f4")
    span = batch.DeviceSpan(data.data_ptr(), data.numel(), "<f4")
    codec = batch.codec_for(spec, own, chunk)
    scratch = Path(tempfile.mkdtemp(prefix="host-blocking-"))
    results = []

    def as_arrays() -> None:
        nvcomp.as_arrays(span, offsets, sizes, cuda_stream=own.cuda_stream)

    def encode() -> None:
        batch.encode(spec, span, offsets, sizes, own, chunk, [])

    def encode_and_sizes() -> None:
        batch.encode(spec, span, offsets, sizes, own, chunk, []).sizes()

    def codec_encode_only() -> None:
        sources = nvcomp.as_arrays(span, offsets, sizes, cuda_stream=own.cuda_stream)
        bound = (batch.max_compressed_bytes(spec, chunk, codec, span) + 15) // 16 * 16
        out = torch.empty(len(sizes) * bound, dtype=torch.uint8, device=device)
        outputs = nvcomp.as_arrays(
            batch.DeviceSpan(out.data_ptr(), out.numel()),
            [i * bound for i in range(len(sizes))],
            [bound] * len(sizes),
            cuda_stream=own.cuda_stream,
        )
        began = time.perf_counter()
        codec.encode(sources, out=outputs)
        results.append({"call": "  (codec.encode alone, inside the previous)", "host_seconds":
                        time.perf_counter() - began, "gil_ticks_per_ms": float("nan")})  # fmt: skip

    def copy_table() -> None:
        import numpy as np

        n = np.arange(4096, dtype=np.int64)
        kernels.copy_ranges(data.data_ptr() + n * 16, data.data_ptr() + (1 << 27) + n * 16, n * 0 + 16, device, own)

    def checksum() -> None:
        from asyncckpt._gpu.checksum import crc32_device

        crc32_device(data)

    path = scratch / "probe.bin"
    kv = kvikio()
    kv.defaults.set("num_threads", 16)

    def kvikio_pwrite_call() -> None:
        with kv.CuFile(path, "w") as f:
            began = time.perf_counter()
            future = f.pwrite(data, data.numel(), 0)
            results.append({"call": "  (KvikIO pwrite call alone)", "host_seconds": time.perf_counter() - began,
                            "gil_ticks_per_ms": float("nan")})  # fmt: skip
            future.get()

    def empty_alloc() -> None:
        with torch.cuda.stream(own):
            torch.empty(1 << 30, dtype=torch.uint8, device=device)

    calls: list[tuple[str, Callable[[], None]]] = [
        ("nvcomp.as_arrays (4 KiB tables)", as_arrays),
        ("batch.encode (enqueue only)", encode),
        ("batch.encode + sizes()", encode_and_sizes),
        ("nvCOMP codec.encode with tables built", codec_encode_only),
        ("kernels.copy_ranges (4096 ranges)", copy_table),
        ("gpu checksum of 256 MiB", checksum),
        ("KvikIO pwrite 256 MiB device + get", kvikio_pwrite_call),
        ("torch.empty 1 GiB on the stream", empty_alloc),
    ]
    for name, call in calls:
        call()  # warm: codecs built, kernels compiled, allocator pools filled
        for where, stream in (("none", None), ("own stream", own), ("other stream", other)):
            result = probe(name, call, stream, cycles, counter)
            result["sleep_queued_on"] = where
            results.append(result)
        progress.say(f"probe {name}: done")
    counter.close()
    path.unlink(missing_ok=True)
    return results


def _background(kind: str, stop: threading.Event) -> Callable[[], None]:
    from asyncckpt._gpu import batch
    from asyncckpt._gpu.checksum import crc32_device
    from asyncckpt._gpu.specs import CodecSpec

    device = torch.device("cuda")
    data = torch.randn(128 << 20, device=device).view(torch.uint8)  # 512 MiB

    if kind.startswith("python: 1 ms of work every 10 ms"):
        # Not a busy loop: one measured on the H200 made 35 ms steps take 3 s (a GIL convoy: the
        # training thread lets go of the GIL around CUDA calls and waits a switch interval to get it back).

        def busy() -> None:
            while not stop.is_set():
                began = time.perf_counter()
                while time.perf_counter() - began < 0.001:
                    pass
                time.sleep(0.01)

        return busy
    if kind == "checksum kernel, 512 MiB, every 20 ms":

        def checksum_loop() -> None:
            while not stop.is_set():
                crc32_device(data)
                time.sleep(0.02)

        return checksum_loop
    if kind.startswith("nvCOMP"):
        stream, chunk = torch.cuda.Stream(), 1 << 20
        spec = CodecSpec("ans", data_type="<f4")
        span = batch.DeviceSpan(data.data_ptr(), data.numel(), "<f4")
        offsets = list(range(0, data.numel(), chunk))

        def encode_loop() -> None:
            while not stop.is_set():
                batch.encode(spec, span, offsets, [chunk] * len(offsets), stream, chunk, []).sizes()
                time.sleep(0.05)

        return encode_loop
    if kind.startswith("reference memory"):
        return _allocation_loop(kind, stop)
    if kind.startswith("pinned"):
        import os

        scratch = Path(tempfile.mkdtemp(prefix="host-blocking-"))
        piece = 64 << 20
        pinned = [torch.empty(piece, dtype=torch.uint8).pin_memory() for _ in range(2)]
        copier = torch.cuda.Stream()

        def pinned_loop() -> None:
            fd = os.open(scratch / "bg.bin", os.O_WRONLY | os.O_CREAT, 0o600)
            offset = 0
            try:
                while not stop.is_set():
                    for k, start in enumerate(range(0, data.numel(), piece)):
                        host = pinned[k % 2]
                        with torch.cuda.stream(copier):
                            host.copy_(data[start : start + piece], non_blocking=True)
                        copier.synchronize()
                        os.pwrite(fd, host.numpy().data, offset % (4 << 30))
                        offset += piece
            finally:
                os.close(fd)
                (scratch / "bg.bin").unlink(missing_ok=True)

        return pinned_loop
    from asyncckpt._gpu.deps import kvikio

    kv = kvikio()
    scratch = Path(tempfile.mkdtemp(prefix="host-blocking-"))
    threads = int(kind.split("threads=")[1].split(",")[0])

    def write_loop() -> None:
        kv.defaults.set("num_threads", threads)
        kv.defaults.set("task_size", (64 if "task 64" in kind else 16) << 20)
        with kv.CuFile(scratch / "bg.bin", "w") as f:
            offset = 0
            while not stop.is_set():
                f.pwrite(data, data.numel(), offset % (4 << 30)).get()
                offset += data.numel()
        (scratch / "bg.bin").unlink(missing_ok=True)

    return write_loop


ALLOCATION_BLOCK_BYTES = 80 << 20
"""About one tensor of the 1B model: what the reference store allocates per key."""
ALLOCATION_ROUND_BYTES = 2 << 30


def _allocation_loop(kind: str, stop: threading.Event) -> Callable[[], None]:
    """Allocate ``ALLOCATION_ROUND_BYTES`` in blocks the way ``kind`` says, free them, again until ``stop``:
    what the delta reference store's background pass (and a pinned-pool reservation) does beside training."""
    from asyncckpt._gpu.pinned_pool import allocate_block, free_block

    count = ALLOCATION_ROUND_BYTES // ALLOCATION_BLOCK_BYTES
    device = torch.device("cuda", torch.cuda.current_device())
    if "registered only" in kind:
        faulted = [allocate_block(ALLOCATION_BLOCK_BYTES, device, pin=False) for _ in range(count)]

        def register_loop() -> None:
            register, unregister = torch.cuda.cudart().cudaHostRegister, torch.cuda.cudart().cudaHostUnregister
            while not stop.is_set():
                for block in faulted:
                    register(block.data.data_ptr(), block.nbytes, 1)
                for block in faulted:
                    unregister(block.data.data_ptr())
            for block in faulted:
                free_block(block)

        return register_loop
    side = torch.cuda.Stream(device)

    def loop() -> None:
        with torch.cuda.device(device), torch.cuda.stream(side):
            while not stop.is_set():
                if "device" in kind:
                    held = [torch.empty(ALLOCATION_BLOCK_BYTES, dtype=torch.uint8, device=device) for _ in range(count)]
                    del held
                    torch.cuda.empty_cache()  # the next round allocates from the driver again, as a first save does
                    continue
                blocks = [allocate_block(ALLOCATION_BLOCK_BYTES, device, pin="not pinned" not in kind)
                          for _ in range(count)]  # fmt: skip
                for block in blocks:
                    free_block(block)

    return loop


ALLOCATION_KINDS = [
    "reference memory: pinned blocks of 80 MiB (mmap, faulted by torch threads, cudaHostRegister)",
    "reference memory: host blocks of 80 MiB, faulted by torch threads, not pinned",
    "reference memory: registered only (cudaHostRegister of faulted 80 MiB blocks)",
    # An upper bound: empty_cache also releases training's cached blocks, which the store never does.
    "reference memory: device blocks of 80 MiB (torch.empty on a side stream, then empty_cache)",
]


def interference(steps: int, width: int, layers: int, progress: Progress,
                 only: Sequence[str] = ()) -> list[dict[str, Any]]:  # fmt: skip
    work = Workload(WorkloadConfig(width=width, layers=layers, context=256, device="cuda"))
    for _ in range(10):
        work.step()
    kinds = [
        "none",
        "python: 1 ms of work every 10 ms (GIL)",
        "python: 1 ms of work every 10 ms (GIL), switch interval 0.2 ms",
        "checksum kernel, 512 MiB, every 20 ms",
        "nvCOMP ANS <f4 512 MiB + sizes, every 50 ms",
        "KvikIO compat writes, threads=16, 512 MiB device buffers",
        "KvikIO compat writes, threads=4, 512 MiB device buffers",
        "KvikIO compat writes, threads=16, task 64 MiB, 512 MiB device buffers",
        "KvikIO compat writes, threads=1, 512 MiB device buffers",
        "pinned 64 MiB pieces + os.pwrite, one thread",
        *ALLOCATION_KINDS,
        "none",
    ]
    if only:
        kinds = [k for k in kinds if k == "none" or any(word in k for word in only)]
    rows = []
    for kind in kinds:
        stop = threading.Event()
        thread = None
        if kind != "none":
            thread = threading.Thread(target=_background(kind, stop), daemon=True)
            thread.start()
            time.sleep(0.2)
        interval = sys.getswitchinterval()
        if "switch interval 0.2 ms" in kind:
            sys.setswitchinterval(0.0002)
        times = [work.step() for _ in range(steps)]
        sys.setswitchinterval(interval)
        stop.set()
        if thread is not None:
            thread.join()
        times_in_order, times = times, sorted(times)
        rows.append({"background": kind, "step_ms": [t * 1e3 for t in times_in_order],
                     "mean_ms": statistics.mean(times) * 1e3,
                     "median_ms": times[len(times) // 2] * 1e3, "p90_ms": times[int(len(times) * 0.9)] * 1e3,
                     "max_ms": times[-1] * 1e3})  # fmt: skip
        progress.say(f"interference {kind}: mean {rows[-1]['mean_ms']:.1f} ms")
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--sleep-ms", type=float, default=50.0)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--only", default="", help="comma-separated words: run only the background activities naming one")
    p.add_argument("--no-probes", action="store_true", help="skip the blocking probes")
    args = p.parse_args(argv)
    progress = Progress()
    machine = describe_machine()
    out: dict[str, Any] = {"benchmark": "host_blocking", "date": utc_stamp(),
                           "machine": machine, "versions": versions(), "args": vars(args)}  # fmt: skip
    name = result_name("host-blocking", machine)
    args.out.mkdir(parents=True, exist_ok=True)
    out["probes"] = [] if args.no_probes else blocking_probes(args.sleep_ms, progress)
    write_json(args.out / f"{name}.json", out)  # kept if a later part runs out of time
    only = [word for word in args.only.split(",") if word]
    out["interference"] = interference(args.steps, args.width, args.layers, progress, only)
    lines = [f"# Host blocking and interference — {out['date']}", "",
             f"sleep kernel queued first: {args.sleep_ms} ms", "",
             "| call | sleep queued on | host ms | GIL ticks/ms |", "|---|---|---|---|"]  # fmt: skip
    for r in out["probes"]:
        lines.append(f"| {r['call']} | {r.get('sleep_queued_on', '')} | {r['host_seconds'] * 1e3:.2f} | "
                     f"{r['gil_ticks_per_ms']:.1f} |")  # fmt: skip
    lines += ["", "| background | mean ms | median | p90 | max |", "|---|---|---|---|---|"]
    for r in out["interference"]:
        lines.append(f"| {r['background']} | {r['mean_ms']:.2f} | {r['median_ms']:.2f} | {r['p90_ms']:.2f} | "
                     f"{r['max_ms']:.2f} |")  # fmt: skip
    write_report(args.out, name, out, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
