"""The fast path of flatten() (asyncckpt.frame): same answer as the full walk, and taken at save time.

flatten() captures the common state's containers and builds its skeleton and key paths later;
every test here pins that the result equals the full walk's (``tree._walk``) for states the
fast path takes, and that the skeleton describes the state as it was when flatten() ran.
"""

from __future__ import annotations

import functools
import random
import threading
from collections import OrderedDict
from typing import Any

import pytest
import torch

from asyncckpt import frame
from asyncckpt.tree import _walk, flatten


def _same(state: object) -> None:
    """flatten(state) and the full walk agree on skeleton, keys and leaf memory."""
    fast, full = flatten(state), _walk(state)
    assert fast.skeleton == full.skeleton
    assert [leaf.key for leaf in fast.tensors] == [leaf.key for leaf in full.tensors]
    assert [(t.data_ptr(), t.dtype, t.shape, t.stride()) for t in fast.leaf_tensors] == [
        (leaf.tensor.data_ptr(), leaf.tensor.dtype, leaf.tensor.shape, leaf.tensor.stride()) for leaf in full.tensors
    ]


def _optimizer_state() -> dict[str, Any]:
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    grads = {name: p.grad for name, p in model.named_parameters()}
    return {"model": model.state_dict(), "optim": optimizer.state_dict(), "grads": grads, "step": 7}


def test_a_training_state_takes_the_fast_path_and_matches_the_full_walk() -> None:
    state = _optimizer_state()
    frame.capture(state)  # raises Unusual if the fast path refused it: the comparison below would be vacuous
    _same(state)


def test_tied_and_viewed_tensors_alias_as_in_the_full_walk() -> None:
    base = torch.arange(64, dtype=torch.float32)
    param = torch.nn.Parameter(torch.randn(3))
    state = {
        "embed": base, "head": base.view(64), "square": base.view(8, 8), "t": base.view(8, 8).t(),
        "ints": base.view(torch.int32), "offset": base[1:], "nested": [base, (base.view(8, 8), param)],
        "param": param, "again": OrderedDict(p=param, q=param.detach()), 3: [1, 2.5, "x", None, True],
    }  # fmt: skip
    frame.capture(state)
    _same(state)
    assert flatten(state).leaf_tensors[-1].requires_grad is False  # detached, as the full walk does


@pytest.mark.parametrize(
    "state",
    [
        {"empty": torch.empty(0)},  # empty tensors: one object met twice must be two leaves
        {True: torch.ones(1)},  # bool key: labelled "True", its node a bool
        {"size": torch.Size([2, 3])},
        {"dtype": torch.float16, "device": torch.device("cpu")},
        {"bytes": b"\x00\x01"},
        {"np": __import__("numpy").float64(0.5)},  # a float subclass
        torch.ones(2),  # a tensor at the root
        functools.reduce(lambda inner, _: [inner], range(frame.MAX_DEPTH - 1), [torch.ones(1)]),  # near the limit
    ],
)
def test_states_outside_the_fast_path_take_the_full_walk(state: object) -> None:
    with pytest.raises(frame.Unusual):
        frame.capture(state)
    _same(state)


def _random_state(rng: random.Random, depth: int, pool: list[torch.Tensor]) -> Any:
    """Nested containers of the kinds the fast path takes, with tensors drawn from (and aliasing) ``pool``."""
    roll = rng.random()
    if depth > 3 or roll < 0.35:
        choice = rng.randrange(7)
        if choice < 3:
            t = rng.choice(pool)
            return t if rng.random() < 0.7 else t.view(t.shape)  # a new object over the same memory
        return [rng.randrange(-5, 5), rng.random(), f"s{rng.randrange(9)}", None, rng.random() < 0.5][choice - 3]
    size = rng.randrange(0, 4)
    if roll < 0.6:
        kind = OrderedDict if rng.random() < 0.3 else dict
        keys = [rng.choice([f"k{i}", i, ""]) for i in range(size)]
        return kind((k, _random_state(rng, depth + 1, pool)) for k in keys)
    items = [_random_state(rng, depth + 1, pool) for _ in range(size)]
    return items if rng.random() < 0.5 else tuple(items)


def test_random_nested_states_match_the_full_walk() -> None:
    rng = random.Random(1234)
    pool = [torch.randn(3), torch.randn(2, 2), torch.arange(4, dtype=torch.int64), torch.ones(5, dtype=torch.bfloat16)]
    taken = 0
    for _ in range(300):
        state = {"root": _random_state(rng, 0, pool)}
        try:
            frame.capture(state)
            taken += 1
        except frame.Unusual:
            pass
        _same(state)
    assert taken == 300


def test_the_skeleton_is_the_state_at_flatten_time_even_when_built_later() -> None:
    weight, moment = torch.randn(4), torch.randn(4)
    inner = {"exp_avg": moment, "lr": 0.1}
    state = {"model": {"w": weight}, "optim": [inner, 5]}
    flat = flatten(state)
    expected = _walk(state)
    state["model"]["extra"] = torch.randn(2)  # the caller reuses its containers right after save()
    inner["lr"] = 0.2
    del state["optim"]
    built: list[Any] = []
    thread = threading.Thread(target=lambda: built.append(flat.skeleton))  # built off the calling thread
    thread.start()
    thread.join()
    assert built[0] == expected.skeleton
    assert [leaf.key for leaf in flat.tensors] == ["model/w", "optim/0/exp_avg"]


def test_a_refused_object_still_raises_a_type_error_naming_its_path() -> None:
    with pytest.raises(TypeError, match="'optim/state/0/fn'"):
        flatten({"optim": {"state": {0: {"exp_avg": torch.ones(2), "fn": object()}}}})
