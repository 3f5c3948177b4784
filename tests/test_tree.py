"""flatten(): which leaves are one tensor, which key path each keeps, and what it refuses where.

flatten() decides aliasing from the data pointer first and builds the full key (pointer, device
kind, dtype, shape, stride) only when a pointer repeats; these tests pin that the answer is the
same as comparing full keys for every pair.
"""

from __future__ import annotations

import gc
from collections import OrderedDict

import pytest
import torch

from asyncckpt._tree import MAX_DEPTH, TensorLeaf, flatten


def _ids(skeleton: dict) -> list[int]:
    """The tensor ids of a flat dict's values, in order."""
    return [value["id"] for _, value in skeleton["items"]]


def test_identical_views_of_one_memory_are_one_leaf() -> None:
    weight = torch.randn(8, 4)
    flat = flatten({"embed": weight, "head": weight, "again": weight.view(8, 4), "other": torch.randn(8, 4)})
    assert _ids(flat.skeleton) == [0, 0, 0, 1]
    assert [leaf.key for leaf in flat.tensors] == ["embed", "other"]
    assert all(type(leaf) is TensorLeaf for leaf in flat.tensors)
    assert flat.tensors[0].tensor is weight


def test_views_at_one_address_that_differ_are_distinct_leaves() -> None:
    base = torch.arange(64, dtype=torch.float32)
    views = {
        "flat": base,
        "square": base.view(8, 8),
        "transposed": base.view(8, 8).t(),  # same shape as square, other stride
        "half": base[:32],  # other shape
        "ints": base.view(torch.int32),  # other dtype
        "square_again": base.view(8, 8),  # a later view equal to a view that was not first
        "transposed_again": base.view(8, 8).t(),
        "flat_again": base.view(64),
        "offset": base[1:],  # another address
    }
    flat = flatten(views)
    assert _ids(flat.skeleton) == [0, 1, 2, 3, 4, 1, 2, 0, 5]
    assert [leaf.key for leaf in flat.tensors] == ["flat", "square", "transposed", "half", "ints", "offset"]


def test_empty_tensors_never_alias() -> None:
    base = torch.arange(4.0)
    empty = base[:0]
    flat = flatten({"a": empty, "b": empty, "c": base[2:2], "d": base, "e": torch.empty(0)})
    assert _ids(flat.skeleton) == [0, 1, 2, 3, 4]


def test_leaves_are_detached_and_keep_their_first_key_path() -> None:
    param = torch.nn.Parameter(torch.randn(3))
    state = {"model": OrderedDict(w=param), "optim": {"state": {0: {"exp_avg": torch.zeros(3)}}}, "tied": [param]}
    flat = flatten(state)
    assert [leaf.key for leaf in flat.tensors] == ["model/w", "optim/state/0/exp_avg"]
    assert not flat.tensors[0].tensor.requires_grad
    assert flat.tensors[0].tensor.data_ptr() == param.data_ptr()
    assert flat.skeleton["items"][2][1] == {"t": "list", "items": [{"t": "tensor", "id": 0}]}


@pytest.mark.parametrize(
    ("state", "key"), [(torch.ones(2), "<root>"), ({"": torch.ones(2)}, "<root>"), ({"": {"": [torch.ones(2)]}}, "0")]
)
def test_a_tensor_at_an_empty_path_is_named_root(state: object, key: str) -> None:
    assert flatten(state).tensors[0].key == key


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ({"a": {"b": torch.eye(2).to_sparse()}}, "cannot store torch.sparse_coo tensor at 'a/b'"),
        ({"a": [torch.empty(2, dtype=torch.uint8).view(torch.bits8)]}, "dtype torch.bits8 at 'a/0'"),
        # The dtype is checked before the device: the first problem found is named.
        ({"a": torch.empty(2, dtype=torch.uint8, device="meta").view(torch.bits8)}, "dtype torch.bits8 at 'a'"),
        ({"": torch.empty(2, device="meta")}, "tensor at '<root>' is on the meta device"),
        ({0: {"x": torch.ones(1), "y": object()}}, "at '0/y'"),
    ],
)
def test_refusals_name_the_key_path(state: object, message: str) -> None:
    with pytest.raises(TypeError, match=message.replace(".", r"\.").replace("[", r"\[")):
        flatten(state)


def test_nesting_limit_applies_to_tensors_and_keys_too() -> None:
    def nest(leaf: object, levels: int) -> object:
        for _ in range(levels):
            leaf = {"k": leaf}
        return leaf

    # unflatten() refuses any node deeper than MAX_DEPTH, so flatten() refuses the same states.
    assert flatten(nest(torch.ones(1), MAX_DEPTH)).tensors[0].key == "/".join(["k"] * MAX_DEPTH)
    flatten(nest(3, MAX_DEPTH))
    for leaf in (3, torch.ones(1), {}):
        with pytest.raises(TypeError, match="nested deeper than 64 levels"):
            flatten(nest(leaf, MAX_DEPTH + 1))
    flatten(nest({}, MAX_DEPTH))  # an empty dict at depth 64 has no deeper node
    with pytest.raises(TypeError, match="nested deeper than 64 levels"):
        flatten(nest({(1,): 2}, MAX_DEPTH))  # a tuple key at depth 65


def test_the_cyclic_collector_never_runs_inside_flatten_and_is_left_as_found() -> None:
    model = {f"layer{i}": {"w": torch.ones(2), "b": torch.zeros(2)} for i in range(300)}
    collections_during: list[int] = []
    inside = False

    def record(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and inside:
            collections_during.append(info["generation"])

    threshold = gc.get_threshold()
    gc.callbacks.append(record)
    gc.set_threshold(1)  # any tracked allocation would start a collection
    try:
        inside = True
        flat = flatten(model)  # ~2,000 tracked containers
        inside = False
        assert len(flat.tensors) == 600 and collections_during == [] and gc.isenabled()
        with pytest.raises(TypeError, match="bad"):
            flatten({**model, "bad": object()})
        assert gc.isenabled(), "a refused state left the collector off"
        gc.disable()
        flatten(model)
        assert not gc.isenabled(), "flatten re-enabled a collector its caller had turned off"
    finally:
        inside = False
        gc.enable()
        gc.set_threshold(*threshold)
        gc.callbacks.remove(record)
