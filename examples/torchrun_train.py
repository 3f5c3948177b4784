"""Distributed data-parallel training under torchrun with asyncckpt's native distributed checkpointer.

    torchrun --nproc_per_node 2 examples/torchrun_train.py --dir runs/ddp --steps 40 --save-every 10

Every rank saves its own part (here: the DDP model and optimizer, which are replicas, plus the
rank's own data-sampling RNG, which is not) to ``data-r{rank}.bin``; rank 0 commits the step once
every rank's part is durable, coordinating through the shared run directory only — training's
process group never sees a collective from a background thread. Run it again with more steps to
resume: each rank loads its own part. For a pure replica (no per-rank state) pass
``replicated=True`` and only rank 0 writes. With CUDA it uses NCCL and one GPU per rank; on CPU, gloo.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import asyncckpt
from asyncckpt.distributed import DistributedCheckpointer
from asyncckpt.testing.demo_model import TextBatches, TinyGPT, stdlib_text, train_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="run directory shared by all ranks")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--save-every", type=int, default=10)
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")

    torch.manual_seed(0)  # same initial weights on every rank
    model = TinyGPT(width=64, layers=2, heads=2, context=32).to(device)
    ddp = DistributedDataParallel(model, device_ids=[local_rank] if cuda else None)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=3e-4)
    batches = TextBatches(stdlib_text(1 << 18), model.context, batch=4, device=device, seed=rank)

    # Built on the main thread of every rank: agrees on a session token once (the only collective).
    checkpointer = DistributedCheckpointer(args.dir, keep_last=2, commit_timeout_seconds=120)
    start = 0
    if asyncckpt.latest_step(args.dir) is not None:
        mine = checkpointer.load(map_location=device)  # this rank's own part
        model.load_state_dict(mine["model"])
        optimizer.load_state_dict(mine["optimizer"])
        batches.generator.set_state(mine["data_rng"])
        start = mine["step"]
        if rank == 0:
            print(f"resumed from step {start}", flush=True)

    for step in range(start + 1, args.steps + 1):
        loss = train_step(ddp, optimizer, batches)
        if step % args.save_every == 0:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                     "data_rng": batches.generator.get_state(), "step": step}  # fmt: skip
            checkpointer.save(step, state)  # returns after the snapshot; commit happens in the background
            if rank == 0:
                print(f"step {step}: loss {loss:.3f}", flush=True)
    checkpointer.close()  # waits for the last commit; raises on every rank if any rank's part failed
    if rank == 0:
        print(f"latest checkpoint: step {asyncckpt.latest_step(args.dir)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
