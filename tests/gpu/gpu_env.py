"""Shared pieces of the GPU tests: the skip condition and a small real training state on the GPU."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncckpt._gpu.deps import gpu_path_available

REPO = Path(__file__).resolve().parents[2]


def subprocess_env(**extra: str) -> dict[str, str]:
    """Environment for a child interpreter: the repository first, then whatever path this one had
    (on the GPU machine the wheels live in a PYTHONPATH directory)."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, **extra}


requires_gpu = [
    pytest.mark.gpu,
    pytest.mark.skipif(not gpu_path_available(), reason="needs a CUDA GPU with nvCOMP and KvikIO (the GPU extra)"),
]


class Trainer:
    """A TinyGPT with AdamW on the GPU, trained on stdlib text; ``dtype`` bfloat16 makes a BF16 state."""

    def __init__(
        self,
        width: int = 64,
        layers: int = 2,
        dtype: torch.dtype = torch.float32,
        fused: bool = False,
        autocast: bool = False,
    ) -> None:
        from asyncckpt.testing.demo_model import TextBatches, TinyGPT, stdlib_text

        torch.manual_seed(0)
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.model = TinyGPT(width=width, layers=layers, heads=2, context=64).to(self.device, dtype)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3, fused=fused)
        self.batches = TextBatches(stdlib_text(1 << 20), 64, batch=8, device=self.device)
        self.autocast = autocast

    def backward(self) -> None:
        inputs, targets = self.batches.next()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.autocast):
            logits = self.model(inputs)
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, 256), targets.reshape(-1))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()

    def step(self) -> None:
        self.backward()
        self.optimizer.step()

    def state(self, grads: bool = False) -> dict[str, Any]:
        state: dict[str, Any] = {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}
        if grads:
            state["grads"] = {n: p.grad for n, p in self.model.named_parameters() if p.grad is not None}
        return state
