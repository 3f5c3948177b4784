"""A Hugging Face Trainer whose optimizer, scheduler and RNG states are checkpointed asynchronously.

    python examples/hf_trainer.py --dir runs/hf --steps 20 --save-steps 10
    python examples/hf_trainer.py --dir runs/hf --steps 30 --save-steps 10    # resumes from checkpoint-20

Trains a tiny GPT-2 built from a config (no download) on the Python standard library's source.
Every ``checkpoint-N/`` is a normal Hugging Face checkpoint (``from_pretrained`` reads it; the
last lines show it) whose training state sits in ``checkpoint-N/asyncckpt/``, written by
asyncckpt's worker thread while training goes on. Needs ``pip install "asyncckpt[dist]"``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import transformers
from transformers.trainer_utils import get_last_checkpoint

from asyncckpt.integrations.huggingface import AsyncCkptTrainer
from asyncckpt.testing.demo_model import stdlib_text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="the Trainer's output_dir")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--save-steps", type=int, default=10)
    args = parser.parse_args()

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64,
                                     bos_token_id=0, eos_token_id=0)  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    data = torch.tensor(list(stdlib_text(1 << 16)), dtype=torch.long)[: 512 * 64].view(512, 64)  # bytes as tokens
    dataset = [{"input_ids": row, "labels": row} for row in data]
    training = transformers.TrainingArguments(output_dir=args.dir, max_steps=args.steps, save_steps=args.save_steps,
                                              per_device_train_batch_size=8, learning_rate=1e-3, report_to=[],
                                              logging_steps=args.save_steps, disable_tqdm=True, seed=0)  # fmt: skip
    trainer = AsyncCkptTrainer(model=model, args=training, train_dataset=dataset, asyncckpt_options={"codec": "zstd"})
    resume = get_last_checkpoint(args.dir) if Path(args.dir).is_dir() else None
    print(f"resuming from {resume}" if resume else "starting from scratch", flush=True)
    trainer.train(resume_from_checkpoint=resume)  # returns once every checkpoint is committed
    trainer.close_checkpointer()

    last = get_last_checkpoint(args.dir)
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(last)
    same = all(torch.equal(reloaded.state_dict()[k], v) for k, v in trainer.model.state_dict().items())
    print(f"step {trainer.state.global_step}; from_pretrained({last}) equals the trained model: {same}")


if __name__ == "__main__":
    main()
