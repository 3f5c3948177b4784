"""The state walker (asyncckpt._walker): one answer from the fast capture and the full walk, bit-exact round trips.

flatten() takes the common state through ``frame.capture`` (containers now, skeleton later) and
anything else through the full walk (``tree._walk``); both decide types, aliasing and limits
through ``asyncckpt._walker``. The properties here: any state flattens to the same skeleton, keys
and leaves by either path; the fast path takes exactly the states its contract lists; and a
flattened state rebuilds bit for bit, ties kept. The DCP stager's walk (``walker.map_state``) is
pinned at the end. Example counts: ``HYPOTHESIS_PROFILE=ci`` (default) or ``nightly``.
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict, namedtuple
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from property_states import VIEWS, base_tensors, difference, states, tied_difference

from asyncckpt import _frame as frame
from asyncckpt._tree import _walk, flatten, unflatten
from asyncckpt._walker import FAST_INT, LONG_STR, MAX_DEPTH, TensorTable, map_state

# complex32 tensors: torch warns once per process that ComplexHalf is experimental.
pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning")


def _leaf_view(t: torch.Tensor) -> tuple[object, ...]:
    """What makes two leaves the same tensor: memory and the view of it (and whether it was detached)."""
    return (t.data_ptr(), t.dtype, t.shape, t.stride(), t.is_conj(), t.is_neg(), t.requires_grad)


def _assert_paths_agree(state: object) -> None:
    """flatten(state) and the full walk give one skeleton, one list of keys and the same leaves."""
    fast, full = flatten(state), _walk(state)
    assert fast.skeleton == full.skeleton
    assert fast.keys == full.keys
    assert [_leaf_view(t) for t in fast.leaf_tensors] == [_leaf_view(leaf.tensor) for leaf in full.tensors]
    assert all(a is b.tensor for a, b in zip(fast.leaf_tensors, fast.tensors, strict=True))


def _fast_path_takes(value: object, depth: int = 0) -> bool:
    """The fast path's contract (asyncckpt/_frame.py's docstring), written out independently of it."""
    if isinstance(value, torch.Tensor):
        return value.numel() > 0  # the strategies below make only storable tensors, with memory
    kind = type(value)
    if kind is bool or kind is float or value is None:
        return True
    if kind is int:
        return -FAST_INT < value < FAST_INT  # type: ignore[operator]
    if kind is str:
        return len(value) <= LONG_STR  # type: ignore[arg-type]
    if depth >= MAX_DEPTH - 1:
        return False
    if kind is dict or kind is OrderedDict:
        keys_ok = all(type(k) is str or (type(k) is int and -FAST_INT < k < FAST_INT) for k in value)  # type: ignore[attr-defined]
        return keys_ok and all(_fast_path_takes(v, depth + 1) for v in value.values())  # type: ignore[attr-defined]
    if kind is list or kind is tuple:
        return all(_fast_path_takes(v, depth + 1) for v in value)  # type: ignore[attr-defined]
    return False


@st.composite
def common_states(draw: st.DrawFn) -> dict[str, Any]:
    """Nested states of only what the fast path takes: tied and viewed non-empty tensors, small scalars."""
    pool = draw(st.lists(base_tensors().filter(lambda t: t.numel() > 0), min_size=1, max_size=4))
    tensors = st.tuples(st.integers(0, len(pool) - 1), st.sampled_from(VIEWS)).map(lambda iv: iv[1](pool[iv[0]]))
    scalars = st.one_of(st.integers(-FAST_INT + 1, FAST_INT - 1), st.floats(), st.text(max_size=8), st.booleans(),
                        st.none())  # fmt: skip
    keys = st.one_of(st.text(max_size=4), st.integers(-FAST_INT + 1, FAST_INT - 1))

    def containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        return st.one_of(
            st.lists(children, max_size=4),
            st.lists(children, max_size=4).map(tuple),
            st.dictionaries(keys, children, max_size=4),
            st.dictionaries(keys, children, max_size=4).map(OrderedDict),
        )

    leaves = st.one_of(tensors.filter(lambda t: t.numel() > 0), scalars)
    return {"state": draw(st.recursive(leaves, containers, max_leaves=16))}


@given(state=common_states())
def test_a_common_state_takes_the_fast_path_and_matches_the_full_walk(state: dict[str, Any]) -> None:
    frame.capture(state)  # raises Unusual if the fast path declined: the comparison would be vacuous
    _assert_paths_agree(state)


@given(state=st.one_of(states(), common_states()))
def test_the_fast_path_takes_exactly_what_its_contract_lists(state: dict[str, Any]) -> None:
    try:
        frame.capture(state)
        taken = True
    except frame.Unusual:
        taken = False
    assert taken == _fast_path_takes(state)


@given(state=states())
def test_any_state_gives_one_answer_by_either_path(state: dict[str, Any]) -> None:
    _assert_paths_agree(state)


def _assert_round_trips(state: object) -> None:
    """flatten then unflatten (through JSON, as a manifest holds the skeleton) gives ``state`` back bit for bit."""
    flat = flatten(state)
    skeleton = json.loads(json.dumps(flat.skeleton))
    copies = [t.clone() for t in flat.leaf_tensors]  # one object per leaf, as load() gives
    back = unflatten(skeleton, copies.__getitem__, "test")
    assert (difference(state, back) or tied_difference(state, back)) is None


@given(state=st.one_of(states(), common_states()))
def test_a_flattened_state_rebuilds_bit_for_bit_with_ties_kept(state: dict[str, Any]) -> None:
    _assert_round_trips(state)


def _optimizer_state() -> dict[str, Any]:
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    grads = {name: p.grad for name, p in model.named_parameters()}
    return {"model": model.state_dict(), "optim": optimizer.state_dict(), "grads": grads, "step": 7}


def test_a_training_state_takes_the_fast_path_and_matches_the_full_walk() -> None:
    state = _optimizer_state()
    frame.capture(state)
    _assert_paths_agree(state)


def test_tied_and_viewed_tensors_alias_as_in_the_full_walk() -> None:
    base = torch.arange(64, dtype=torch.float32)
    param = torch.nn.Parameter(torch.randn(3))
    state = {
        "embed": base, "head": base.view(64), "square": base.view(8, 8), "t": base.view(8, 8).t(),
        "ints": base.view(torch.int32), "offset": base[1:], "nested": [base, (base.view(8, 8), param)],
        "param": param, "again": OrderedDict(p=param, q=param.detach()), 3: [1, 2.5, "x", None, True],
    }  # fmt: skip
    frame.capture(state)
    _assert_paths_agree(state)
    _assert_round_trips(state)  # both paths share the aliasing rule: only a round trip can show it wrong
    assert flatten(state).leaf_tensors[-1].requires_grad is False  # detached, as the full walk does


@pytest.mark.parametrize(
    "state",
    [
        {"empty": torch.empty(0)},  # empty tensors: one object met twice must be two leaves
        {"empty_view": torch.arange(4.0)[2:2]},  # empty, at an address
        {True: torch.ones(1)},  # bool key: labelled "True", its node a bool
        {"size": torch.Size([2, 3])},
        {"dtype": torch.float16, "device": torch.device("cpu")},
        {"bytes": b"\x00\x01"},
        {"np": __import__("numpy").float64(0.5)},  # a float subclass
        {"wide": FAST_INT},
        {"long": "x" * (LONG_STR + 1)},
        torch.ones(2),  # a tensor at the root
        functools.reduce(lambda inner, _: [inner], range(MAX_DEPTH - 1), [torch.ones(1)]),  # near the limit
    ],
)
def test_states_outside_the_fast_path_take_the_full_walk(state: object) -> None:
    with pytest.raises(frame.Unusual):
        frame.capture(state)
    _assert_paths_agree(state)


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


def test_the_tensor_table_refuses_by_key_path_and_keeps_empty_tensors_apart() -> None:
    table = TensorTable()
    empty = torch.empty(0)
    assert [table.add(empty, "a"), table.add(empty, "b")] == [0, 1]
    with pytest.raises(TypeError, match="cannot store torch.sparse_coo tensor at 'm/w'"):
        table.add(torch.ones(2).to_sparse(), "m/w")
    with pytest.raises(TypeError, match="tensor at '<root>' is on the meta device"):
        table.add(torch.empty(2, device="meta"), "")
    assert TensorTable().add_common([torch.ones(1), empty]) is None  # empty: the full walk's case


def test_the_dcp_walk_copies_dict_list_and_tuple_containers_and_maps_every_other_value() -> None:
    point = namedtuple("point", "x y")(1, 2)
    state = OrderedDict(model={"w": torch.ones(1)}, extra=[(3, point)], size=torch.Size([2]))
    seen: list[tuple[object, str]] = []
    out = map_state(state, lambda value, where: seen.append((value, where)) or where)
    assert type(out) is dict and type(out["model"]) is dict  # any dict comes back as a plain dict, as DCP's
    assert out == {"model": {"w": "model/w"}, "extra": [("extra/0/0", "extra/0/1")], "size": "size"}
    assert [value for value, _ in seen][2:] == [point, torch.Size([2])]  # a namedtuple and a Size are leaves
