"""The fast path of :func:`asyncckpt._tree.flatten`: freeze the containers now, describe them later.

``save()`` must take the state's structure before it returns (the caller may then change its
dicts), but the JSON skeleton and the key paths are only read later, by the compressor and
the worker. So on the training thread :func:`capture` copies each container into a
:class:`Frame` (keys and values, no JSON, no paths) and collects the distinct tensors; on
whichever thread first asks, :func:`describe` turns the frame into the skeleton and the key
path of each tensor, which halves the training thread's share of the walk
(docs/benchmarks.md, "Why the GPU path is built this way").

:func:`capture` takes only the common case, in the terms of :mod:`asyncckpt._walker`: exact
:data:`~asyncckpt._walker.CONTAINER_TAGS` containers with ``str``/``int`` keys, exact
:data:`~asyncckpt._walker.SCALAR_TAGS` scalars (ints inside +-:data:`~asyncckpt._walker.FAST_INT`,
strs of at most :data:`~asyncckpt._walker.LONG_STR` characters), and storable non-empty tensors
with memory (:meth:`~asyncckpt._walker.TensorTable.add_common`), not nested near
:data:`~asyncckpt._walker.MAX_DEPTH`. Anything else raises :class:`Unusual`, and ``flatten`` runs
the full walk, which stores the other types and names the key path of anything it refuses.
Both walks give the same skeleton, keys and leaves (``tests/test_walker.py`` checks them).

Frame nodes: a dict is ``(container type, keys tuple, values list)``; a list or tuple is
``(container type, values list)``; a value is a frame node (always a ``tuple``: user tuples
become nodes), a scalar, or a tensor.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import torch

from ._walker import CONTAINER_TAGS, FAST_INT, LONG_STR, MAX_DEPTH, SCALAR_TAGS, TensorTable, scalar_node


class Unusual(Exception):
    """The state holds something :func:`capture` does not take; the full walk must run."""


class Frame:
    """The containers of a state, copied, and its distinct tensors. Built on the training thread;
    :meth:`described` may run on any thread, once (under a lock)."""

    __slots__ = ("_described", "_lock", "index_of", "root", "tensors")

    def __init__(self, root: tuple[Any, ...], tensors: list[torch.Tensor], index_of: dict[int, int]) -> None:
        self.root = root
        self.tensors = tensors
        """Distinct tensors in first-seen order (detached where they required grad)."""
        self.index_of = index_of
        """``id()`` of every tensor object in the frame -> its index in ``tensors``."""
        self._lock = threading.Lock()
        self._described: tuple[dict[str, Any], list[str]] | None = None

    def described(self) -> tuple[dict[str, Any], list[str]]:
        """(skeleton, key path of each tensor), computed on first call."""
        with self._lock:
            if self._described is None:
                self._described = describe(self)
            return self._described


def capture(state: object) -> Frame:
    """Copy the containers of ``state`` and collect its distinct tensors. Training thread.

    The walk only lists the tensors it meets; :meth:`~asyncckpt._walker.TensorTable.add_common`
    then checks and deduplicates them in one loop, which costs less than doing so in the walk.

    Raises:
        Unusual: anything but the common case (module docstring); nothing is left changed.
    """
    occurrences: list[torch.Tensor] = []
    # Locals, not globals or attribute lookups, in the loops below.
    found, tensor_type, ordered_dict, scalars, wide, long_str = (
        occurrences.append, torch.Tensor, OrderedDict, SCALAR_TAGS, FAST_INT, LONG_STR
    )  # fmt: skip

    def node(obj: object, depth: int) -> tuple[Any, ...]:
        if depth >= MAX_DEPTH - 1:  # near the limit the full walk decides exactly where it lies
            raise Unusual
        kind = type(obj)
        if kind is dict or kind is ordered_dict:
            values: list[Any] = []
            add = values.append
            for key, value in obj.items():  # type: ignore[attr-defined]
                key_kind = type(key)
                if key_kind is not str and (key_kind is not int or not -wide < key < wide):
                    raise Unusual
                if isinstance(value, tensor_type):
                    found(value)
                    add(value)
                elif type(value) in scalars:
                    if type(value) is int and not -wide < value < wide:
                        raise Unusual
                    if type(value) is str and len(value) > long_str:
                        raise Unusual
                    add(value)
                else:
                    add(node(value, depth + 1))
            return (kind, tuple(obj), values)  # type: ignore[arg-type]
        if kind is list or kind is tuple:
            items: list[Any] = []
            for value in obj:  # type: ignore[attr-defined]
                if isinstance(value, tensor_type):
                    found(value)
                    items.append(value)
                elif type(value) in scalars:
                    if type(value) is int and not -wide < value < wide:
                        raise Unusual
                    if type(value) is str and len(value) > long_str:
                        raise Unusual
                    items.append(value)
                else:
                    items.append(node(value, depth + 1))
            return (kind, items)
        raise Unusual

    root = node(state, 0)
    table = TensorTable()
    index_of = table.add_common(occurrences)
    if index_of is None:
        raise Unusual
    return Frame(root, table.tensors, index_of)


def describe(frame: Frame) -> tuple[dict[str, Any], list[str]]:
    """The skeleton of a captured state (the format of :mod:`asyncckpt._tree`) and each tensor's key path.

    Walks the frame in the order :func:`capture` did, so a tensor's key is the path of its
    first occurrence, as in the full walk. Any thread; reads only the frame.
    """
    keys: list[str | None] = [None] * len(frame.tensors)
    index_of, scalars, container_tags = frame.index_of, SCALAR_TAGS, CONTAINER_TAGS

    def value_node(value: object, where: str) -> dict[str, Any]:
        kind = type(value)
        if kind is tuple:
            return container_node(value, where)  # type: ignore[arg-type]
        if kind in scalars:
            return scalar_node(value)
        index = index_of[id(value)]
        if keys[index] is None:
            keys[index] = where or "<root>"  # as the full walk names a tensor under "" keys
        return {"t": "tensor", "id": index}

    def container_node(frame_node: tuple[Any, ...], where: str) -> dict[str, Any]:
        if len(frame_node) == 3:
            kind, dict_keys, values = frame_node
            items = []
            for key, value in zip(dict_keys, values, strict=True):
                label = key if type(key) is str else str(key)
                key_node = {"t": "str" if type(key) is str else "int", "v": key}
                items.append([key_node, value_node(value, f"{where}/{label}" if where else label)])
            return {"t": container_tags[kind], "items": items}
        kind, values = frame_node
        prefix = f"{where}/" if where else ""
        return {"t": container_tags[kind], "items": [value_node(v, f"{prefix}{i}") for i, v in enumerate(values)]}

    skeleton = container_node(frame.root, "")
    assert all(key is not None for key in keys), "every captured tensor occurs in its frame"
    return skeleton, keys  # type: ignore[return-value]
