"""The fast path of :func:`asyncckpt.tree.flatten`: freeze the containers now, describe them later.

``save()`` must take the state's structure before it returns (the caller may then change its
dicts), but the JSON skeleton and the key paths are only read later, by the compressor and
the worker. So on the training thread :func:`capture` copies each container into a
:class:`Frame` (keys and values, no JSON, no paths) and collects the distinct tensors; on
whichever thread first asks, :func:`describe` turns the frame into the skeleton and the key
path of each tensor, which halves the training thread's share of the walk
(docs/benchmarks.md, "Why the GPU path is built this way").

:func:`capture` takes only the common case: exact ``dict``/``OrderedDict``/``list``/``tuple``
containers with ``str``/``int`` keys, exact ``int``/``float``/``str``/``bool``/``None``
scalars (ints inside +-2**64, strs of at most 4 KiB), and storable non-empty strided CPU/CUDA
tensors with memory (not nested tensors), not nested near :data:`MAX_DEPTH`. Anything else
raises :class:`Unusual`, and ``flatten`` runs the full walk, which stores the other types
and names the key path of anything it refuses. Both walks give the same skeleton, keys and
leaves (``tests/test_frame.py`` compares them).

Frame nodes: a dict is ``(container type, keys tuple, values list)``; a list or tuple is
``(container type, values list)``; a value is a frame node (always a ``tuple``: user tuples
become nodes), a scalar, or a tensor.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from .dtypes import NAME_BY_DTYPE
from .floats import float_text

MAX_DEPTH = 64
"""Deepest container nesting accepted on save and on load (state dicts nest 4-6 deep)."""

_SCALARS = frozenset({int, float, str, bool, type(None)})

MAX_INT_BITS = 9600
"""Widest int stored (about 2,890 decimal digits): Python refuses to print or parse ints of more
than 4,300 digits, and the manifest holds ints as JSON numbers."""

_FAST_INT = 1 << 64
""":func:`capture` takes ints strictly inside +-2**64; wider ones go to the full walk, which checks them."""

_LONG_STR = 4096
"""Longer str values go to the full walk, which counts the text a manifest can hold."""


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


def alias_index(t: torch.Tensor, ptr: int, first: int, seen: torch.Tensor,
                by_alias: dict[tuple[object, ...], int], append: Callable[[torch.Tensor], int]) -> int:  # fmt: skip
    """The leaf index of non-empty ``t`` at the data pointer ``ptr`` of an earlier leaf ``seen`` (index ``first``).

    Two leaves are the same tensor if they are identical views of the same memory (tied
    weights appear twice in a state_dict): stored once, restored as one object. Views that
    differ in dtype, shape, stride or in the lazy conjugate and negative bits (``z.conj()`` and
    ``z.conj().imag`` share ``z``'s memory but not its values) are distinct leaves, added with
    ``append``. CPU and CUDA pointers never coincide (unified virtual addressing), nor do two
    GPUs'; the device kind is in the key all the same. ``first`` gets its key here, at the
    first collision; every other non-empty leaf at this address came through here and has its
    key already.
    """
    by_alias.setdefault(
        (ptr, seen.is_cuda, seen.dtype, seen.shape, seen.stride(), seen.is_conj(), seen.is_neg()), first
    )
    key = (ptr, t.is_cuda, t.dtype, t.shape, t.stride(), t.is_conj(), t.is_neg())
    index = by_alias.get(key)
    if index is None:
        index = by_alias[key] = append(t)
    return index


def capture(state: object) -> Frame:
    """Copy the containers of ``state`` and collect its distinct tensors. Training thread.

    Reads each tensor's layout, dtype, device kind, nestedness, element count, data pointer and
    requires_grad once, and nothing else: what aliasing and the storable check need.

    Raises:
        Unusual: anything but the common case (module docstring); nothing is left changed.
    """
    tensors: list[torch.Tensor] = []
    index_by_ptr: dict[int, int] = {}
    index_by_alias: dict[tuple[object, ...], int] = {}
    index_of: dict[int, int] = {}
    # Locals, not globals or attribute lookups, in the loops below.
    tensor_type, strided, ordered_dict, known_dtypes, scalars, wide, long_str = (
        torch.Tensor, torch.strided, OrderedDict, NAME_BY_DTYPE, _SCALARS, _FAST_INT, _LONG_STR
    )  # fmt: skip

    def append(t: torch.Tensor) -> int:
        tensors.append(t.detach() if t.requires_grad else t)
        return len(tensors) - 1

    def tensor_index(t: torch.Tensor) -> int:
        # Empty tensors are never aliased, so one empty tensor object met twice is two leaves,
        # which ``index_of`` (one index per object) cannot say: the full walk takes them.
        if not (t.layout is strided and t.dtype in known_dtypes and (t.is_cuda or t.is_cpu) and not t.is_nested
                and t.numel()):  # fmt: skip
            raise Unusual
        if not (ptr := t.data_ptr()):  # freed storage: the full walk refuses it by name
            raise Unusual
        if ptr not in index_by_ptr:
            index = index_by_ptr[ptr] = append(t)
        else:
            first = index_by_ptr[ptr]
            index = alias_index(t, ptr, first, tensors[first], index_by_alias, append)
        index_of[id(t)] = index
        return index

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
                    # The common leaf, tensor_index() inlined: storable, non-empty, at a new address.
                    if (
                        value.layout is strided
                        and value.dtype in known_dtypes
                        and (value.is_cuda or value.is_cpu)
                        and not value.is_nested
                        and value.numel()
                        and (ptr := value.data_ptr())
                        and ptr not in index_by_ptr
                    ):
                        index_by_ptr[ptr] = index_of[id(value)] = len(tensors)
                        tensors.append(value.detach() if value.requires_grad else value)
                    else:
                        tensor_index(value)
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
                    tensor_index(value)
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
    return Frame(root, tensors, index_of)


def describe(frame: Frame) -> tuple[dict[str, Any], list[str]]:
    """The skeleton of a captured state (the format of :mod:`asyncckpt.tree`) and each tensor's key path.

    Walks the frame in the order :func:`capture` did, so a tensor's key is the path of its
    first occurrence, as in the full walk. Any thread; reads only the frame.
    """
    keys: list[str | None] = [None] * len(frame.tensors)
    index_of = frame.index_of

    def value_node(value: object, where: str) -> dict[str, Any]:
        kind = type(value)
        if kind is tuple:
            return container_node(value, where)  # type: ignore[arg-type]
        if kind is bool:
            return {"t": "bool", "v": value}
        if kind is int:
            return {"t": "int", "v": value}
        if kind is float:
            return {"t": "float", "v": float_text(value)}  # type: ignore[arg-type]
        if kind is str:
            return {"t": "str", "v": value}
        if value is None:
            return {"t": "none"}
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
            return {"t": "odict" if kind is OrderedDict else "dict", "items": items}
        kind, values = frame_node
        prefix = f"{where}/" if where else ""
        return {"t": kind.__name__, "items": [value_node(v, f"{prefix}{i}") for i, v in enumerate(values)]}

    skeleton = container_node(frame.root, "")
    assert all(key is not None for key in keys), "every captured tensor occurs in its frame"
    return skeleton, keys  # type: ignore[return-value]
