"""``asyncckpt demo``: train a small model, checkpoint asynchronously, compare with torch.save, restore.

What it shows, measured in one run on this machine: the training stall of each asynchronous
save next to a synchronous ``torch.save`` (+ fsync) of the very same state, the bytes raw and
stored, and a bit-for-bit check of the restored latest checkpoint against the state captured
at its save() call. Runs on the GPU when one is present, else on the CPU (under a minute on
two cores with the defaults).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from .._checkpointer import AsyncCheckpointer
from .._loader import load
from ..testing.state_compare import clone_state, first_difference


def register(sub: Any) -> None:
    parser = sub.add_parser("demo", help="train a small model with async checkpoints and compare with torch.save")
    parser.add_argument(
        "--dir", default=None, help="run directory, kept afterwards (default: a temporary one, removed at the end)"
    )
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--width", type=int, default=256, help="model width (layers=4): 256 is ~3.4M parameters")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--codec", default=None, help="codec (default: auto)")
    parser.add_argument("--keep-last", type=int, default=3)
    parser.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    parser.add_argument(
        "--hold-seconds",
        type=float,
        default=0.0,
        help="keep the process (and its metrics endpoint) alive this long after finishing",
    )
    parser.add_argument(
        "--start-file",
        type=Path,
        default=None,
        help="wait (up to 120 s) until this file exists before training, with the metrics endpoint "
        "already up: a harness lets Prometheus scrape the zeroed counters first, so rate() sees every save",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..testing.demo_model import TextBatches, TinyGPT, stdlib_text, train_step

    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))  # fmt: skip
    torch.manual_seed(0)
    directory = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="asyncckpt-demo-"))
    model = TinyGPT(width=args.width).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    batches = TextBatches(stdlib_text(), model.context, batch=8, device=device)
    params = sum(p.numel() for p in model.parameters())
    print(f"asyncckpt demo: {params / 1e6:.1f}M-parameter transformer on {device}, checkpoints in {directory}")

    rows, reference, last_step = [], None, None
    sync_dir = Path(tempfile.mkdtemp(prefix="asyncckpt-torchsave-"))
    with AsyncCheckpointer(directory, keep_last=args.keep_last, codec=args.codec,
                           metrics_port=args.metrics_port) as ckpt:  # fmt: skip
        if args.start_file is not None:
            _wait_for(args.start_file, timeout=120.0)
        began = time.perf_counter()
        for step in range(1, args.steps + 1):
            loss = train_step(model, optimizer, batches)
            if step % args.save_every:
                continue
            state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": step, "loss": loss}
            sync_seconds = _timed_torch_save(state, sync_dir / f"step-{step}.pt", device)
            handle = ckpt.save(step, state, metadata={"loss": loss})
            reference, last_step = clone_state(state), step  # the state at save() time, for the final check
            rows.append((step, loss, handle, sync_seconds))
            print(
                f"  step {step:4d}  loss {loss:.3f}  save() returned after {handle.stall_seconds * 1e3:.2f} ms "
                f"(torch.save took {sync_seconds * 1e3:.1f} ms)",
                flush=True,
            )
        train_seconds = time.perf_counter() - began
    _print_table(rows, train_seconds)

    restored = load(directory, map_location=device)
    difference = first_difference(reference, restored)
    if difference is not None:
        print(f"FAILED: restored step {last_step} differs from the state at save time: {difference}")
        return 1
    print(f"restored step {last_step} from {directory}: bit-for-bit equal to the state at save() time")
    shutil.rmtree(sync_dir)
    if args.dir is None:  # a failed run keeps it (above), for a look with asyncckpt ls/inspect/verify
        shutil.rmtree(directory)
        print(f"removed {directory} (pass --dir to keep the checkpoints)")
    if args.hold_seconds > 0:
        print(f"holding for {args.hold_seconds:.0f} s (metrics stay up)", flush=True)
        time.sleep(args.hold_seconds)
    return 0


def _wait_for(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"asyncckpt demo: {path} did not appear within {timeout:.0f} s (--start-file)")
        time.sleep(0.1)


def _timed_torch_save(state: dict[str, Any], path: Path, device: torch.device) -> float:
    """Seconds a synchronous torch.save + fsync of ``state`` blocks training."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    began = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - began
    path.unlink()  # only its time matters; kept, a long demo (deploy/'s trainer) would fill the disk
    return seconds


def _print_table(rows: list[tuple[int, float, Any, float]], train_seconds: float) -> None:
    print()
    print(f"{'step':>6}  {'async stall ms':>14}  {'torch.save ms':>13}  {'durable ms':>10}  {'raw MB':>8}  "
          f"{'stored MB':>9}  {'ratio':>6}")  # fmt: skip
    stalls, syncs = [], []
    for step, _loss, handle, sync_seconds in rows:
        result = handle.result()
        stalls.append(result.stall_seconds)
        syncs.append(sync_seconds)
        print(f"{step:>6}  {result.stall_seconds * 1e3:>14.2f}  {sync_seconds * 1e3:>13.1f}  "
              f"{result.durable_seconds * 1e3:>10.1f}  {result.raw_bytes / 1e6:>8.2f}  "
              f"{result.stored_bytes / 1e6:>9.2f}  {result.ratio:>6.3f}")  # fmt: skip
    if stalls:
        median_async, median_sync = statistics.median(stalls), statistics.median(syncs)
        print(f"median stall: async {median_async * 1e3:.2f} ms vs torch.save {median_sync * 1e3:.1f} ms "
              f"({median_sync / max(median_async, 1e-9):.0f}x less time blocked); training loop took "
              f"{train_seconds:.1f} s")  # fmt: skip
