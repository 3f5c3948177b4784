"""Helpers for tests, demos, examples and benchmarks; nothing on the checkpointing path imports them.

- :mod:`asyncckpt.testing.demo_model`: a small GPT (``TinyGPT``) trained on the Python standard
  library's own source text, so demos and benchmarks checkpoint real training state without a
  download.
- :mod:`asyncckpt.testing.state_compare`: ``clone_state`` and ``first_difference``, a bit-exact
  comparison of two states (tensors compared as bytes, so NaN payloads count) for checking a
  restore in your own tests.
"""

from .state_compare import clone_state, first_difference

__all__ = ["clone_state", "first_difference"]
