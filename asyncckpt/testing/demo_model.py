"""A small causal transformer trained on real text: the Python standard library's own source.

Used by the demo, the benchmarks and the tests wherever "real training state" is needed:
random tensors do not compress like trained weights and Adam moments do, and the standard
library's source files are on every machine. Byte-level vocabulary (256), so no tokenizer.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn


def stdlib_text(limit_bytes: int = 4 << 20) -> bytes:
    """Up to ``limit_bytes`` of the standard library's ``.py`` files, concatenated in a fixed order."""
    root = Path(os.__file__).parent
    out, size = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        out.append(data)
        size += len(data)
        if size >= limit_bytes:
            break
    return b"".join(out)[:limit_bytes]


class TinyGPT(nn.Module):
    """Pre-norm causal transformer language model over bytes."""

    def __init__(self, width: int = 256, layers: int = 4, heads: int = 4, context: int = 128) -> None:
        super().__init__()
        self.context = context
        self.embed = nn.Embedding(256, width)
        self.position = nn.Embedding(context, width)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 256, bias=False)
        self.head.weight = self.embed.weight  # tied, as in GPT-2: two state_dict keys, one tensor
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.position.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=tokens.device)
        x = self.embed(tokens) + self.position(torch.arange(length, device=tokens.device))
        return self.head(self.norm(self.blocks(x, mask=mask, is_causal=True)))


class TextBatches:
    """Random windows of the text as (input, target) byte tensors."""

    def __init__(self, text: bytes, context: int, batch: int, device: torch.device, seed: int = 0) -> None:
        self.data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        self.context, self.batch, self.device = context, batch, device
        self.generator = torch.Generator().manual_seed(seed)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, self.data.numel() - self.context - 1, (self.batch,), generator=self.generator)
        windows = torch.stack([self.data[s : s + self.context + 1] for s in starts.tolist()]).to(self.device)
        return windows[:, :-1], windows[:, 1:]


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batches: TextBatches) -> float:
    inputs, targets = batches.next()
    logits = model(inputs)
    loss = nn.functional.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return float(loss.detach())
