"""Where the compressor thread's host time goes while it queues a snapshot (``fence`` mode's gate time).

In ``fence`` mode the next optimizer step waits until every group of the snapshot is queued on
the compressor's stream, so the host time of :meth:`GpuEncoder._enqueue` over a whole state is
what training may wait for. This runs it alone on the benchmark workload's real state under
cProfile (no training beside it) and prints the wall time and the top functions.

Usage (GPU machine): ``python3 -m benchmarks.enqueue_profile [--width 4096 --layers 5]``.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from collections.abc import Sequence

import torch

from asyncckpt._gpu.budget import MAX_GROUP_BYTES
from asyncckpt._gpu.pipeline import GpuEncoder
from asyncckpt._snapshot.base import StagedTensor
from asyncckpt._tree import flatten

from .common import Workload, WorkloadConfig


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--group-bytes", type=int, default=MAX_GROUP_BYTES)
    args = p.parse_args(argv)
    work = Workload(WorkloadConfig(width=args.width, layers=args.layers, context=256, device="cuda"))
    for _ in range(3):
        work.step()
    torch.cuda.synchronize()
    leaves = [leaf.tensor for leaf in flatten(work.state()).tensors if leaf.tensor.is_cuda]
    tensors = [
        StagedTensor(f"t{i}", t.dtype, tuple(t.shape), t.device, t.detach().reshape(-1).view(torch.uint8))
        for i, t in enumerate(leaves)
    ]
    encoder = GpuEncoder("auto", torch.device("cuda"))
    for _blob in encoder._encode_inline(tensors):  # probes: the chooser settles, codecs and caches built
        pass
    for repeat in range(args.repeats):
        profile = cProfile.Profile() if repeat == args.repeats - 1 else None
        torch.cuda.synchronize()
        began = time.perf_counter()
        if profile is not None:
            profile.enable()
        with torch.cuda.stream(encoder.stream):
            works = [encoder._enqueue(group) for group in encoder._plan(tensors, args.group_bytes)]
        if profile is not None:
            profile.disable()
        queued = time.perf_counter() - began
        encoder.stream.synchronize()
        print(f"repeat {repeat}: {len(works)} groups of {len(tensors)} tensors queued in {queued * 1e3:.1f} ms "
              f"(GPU done {(time.perf_counter() - began) * 1e3:.1f} ms)")  # fmt: skip
        del works
        if profile is not None:
            stats = pstats.Stats(profile)
            stats.sort_stats("tottime").print_stats(18)
            stats.sort_stats("cumulative").print_stats(18)
    encoder.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
