"""Integrations with training frameworks; each module imports its framework only when imported itself.

* :mod:`asyncckpt.integrations.dcp` — ``torch.distributed.checkpoint`` storage writer/reader and async stager
  (FSDP2, torchtitan, plain DCP).
* :mod:`asyncckpt.integrations.lightning` — a Lightning ``CheckpointIO`` plugin.
* :mod:`asyncckpt.integrations.huggingface` — a Hugging Face ``Trainer`` that saves through asyncckpt.
"""
