"""The invariant: a checkpoint holds exactly the state at save() time, whatever training does next.

A real training loop steps the optimizer (mutating every parameter and moment in place)
immediately after each save() returns, while the worker is still compressing and writing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import asyncckpt
from asyncckpt.testing.demo_model import TextBatches, TinyGPT, stdlib_text, train_step
from asyncckpt.testing.state_compare import clone_state, first_difference


@pytest.mark.parametrize("max_inflight", [1, 3])
def test_training_right_after_save_never_tears_the_checkpoint(run_dir: Path, max_inflight: int) -> None:
    torch.manual_seed(0)
    model = TinyGPT(width=64, layers=2, heads=2, context=32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = TextBatches(stdlib_text(1 << 18), model.context, batch=4, device=torch.device("cpu"))
    references = {}
    with asyncckpt.AsyncCheckpointer(run_dir, max_inflight=max_inflight, zstd_level=3) as ckpt:
        for step in range(1, 13):
            train_step(model, optimizer, batches)
            if step % 3 == 0:
                state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": step}
                ckpt.save(step, state)
                references[step] = clone_state(state)
                # Mutate at once: the next training step and a direct in-place write.
                train_step(model, optimizer, batches)
                with torch.no_grad():
                    next(model.parameters()).add_(1.0)
    for step, reference in references.items():
        restored = asyncckpt.load(run_dir, step=step)
        assert first_difference(reference, restored) is None, f"step {step} is torn"
