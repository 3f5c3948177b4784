"""A plain PyTorch training loop with asynchronous checkpoints, resuming from the latest one.

    python examples/train_loop.py --dir runs/loop --steps 200 --save-every 50
    python examples/train_loop.py --dir runs/loop --steps 300 --save-every 50     # resumes at step 200

``save()`` returns once the state is snapshotted (host copy here; GPU staging with the GPU
extra), so the next optimizer step may run at once; compression, writing and the atomic commit
happen on asyncckpt's worker thread. A failed background save is raised by a later ``save()``
or by ``close()`` (the ``with`` block), never lost.
"""

from __future__ import annotations

import argparse
import time

import torch

import asyncckpt
from asyncckpt.testing.demo_model import TextBatches, TinyGPT, stdlib_text, train_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="run directory for checkpoints")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--save-every", type=int, default=50)
    parser.add_argument("--keep-last", type=int, default=3)
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = TinyGPT(width=128, layers=2, heads=4, context=64).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    batches = TextBatches(stdlib_text(1 << 20), model.context, batch=8, device=device)

    start = 0
    if asyncckpt.latest_step(args.dir) is not None:
        state = asyncckpt.load(args.dir)  # tensors come back on the devices they were saved from
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        batches.generator.set_state(state["data_rng"])
        start = state["step"]
        print(f"resumed from step {start}")

    with asyncckpt.AsyncCheckpointer(args.dir, keep_last=args.keep_last) as checkpointer:
        for step in range(start + 1, args.steps + 1):
            loss = train_step(model, optimizer, batches)
            if step % args.save_every == 0:
                began = time.perf_counter()
                state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                         "data_rng": batches.generator.get_state(), "step": step}  # fmt: skip
                checkpointer.save(step, state, metadata={"loss": loss})
                print(f"step {step}: loss {loss:.3f}, save() blocked training for "
                      f"{(time.perf_counter() - began) * 1e3:.1f} ms")  # fmt: skip
    print(f"latest checkpoint: step {asyncckpt.latest_step(args.dir)}")


if __name__ == "__main__":
    main()
