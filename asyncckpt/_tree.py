"""Flatten a training state into tensors plus a typed-JSON skeleton, and back.

The skeleton is how a manifest records "the non-tensor structure of the state" without
pickle: every node is a small JSON object tagged with its Python type, so loading can
rebuild exactly the containers and scalars that were saved (int keys stay ints, tuples
stay tuples, ``nan`` stays ``nan``) and can never construct any other type. Subclasses of
``int``, ``float``, ``str`` and ``bytes`` (an ``IntEnum`` member, a ``str``-mixin ``Enum`` member
such as Hugging Face's ``ExplicitEnum``, a ``bytearray``) are stored as their base value (``1``,
``'red'``, never ``'Color.RED'``), as values and as dict keys alike, and load as the base type,
since loading never constructs a user class;
container subclasses (namedtuples, ``defaultdict``) are refused, because they would load as
another kind of container.

Node forms (``t`` is the tag)::

    {"t": "dict" | "odict", "items": [[key_node, value_node], ...]}
    {"t": "list" | "tuple" | "size", "items": [node, ...]}
    {"t": "tensor", "id": <index into the manifest's tensor table>}
    {"t": "int", "v": 3}        {"t": "float", "v": "0x1.8p+1"}  (exact: asyncckpt._floats, NaN bits too)
    {"t": "str", "v": "..."}    {"t": "bool", "v": true}          {"t": "none"}
    {"t": "bytes", "v": "<base64>"}   {"t": "dtype", "v": "bfloat16"}   {"t": "device", "v": "cuda:0"}

Both directions run on the calling thread and touch no tensor data. ``flatten`` takes the
common state through :mod:`asyncckpt._frame` (containers copied now, skeleton and key paths
built on first use, off the training thread) and anything else through the full walk here.
"""

from __future__ import annotations

import base64
import binascii
import functools
import gc
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from ._dtypes import DTYPE_BY_NAME, dtype_name
from ._floats import float_from_text, float_text
from ._frame import Frame, Unusual, capture
from ._manifest import MAX_MANIFEST_BYTES
from ._walker import CONTAINER_TAGS, MAX_DEPTH, TensorTable, join, key_label, storable_int, too_deep, unsupported
from .errors import CorruptCheckpointError

__all__ = ["MAX_DEPTH", "FlatState", "TensorLeaf", "flatten", "unflatten"]


class TensorLeaf(NamedTuple):
    """One distinct tensor found in the state, in first-seen order.

    A NamedTuple rather than a dataclass: ``flatten`` builds one per tensor on the training
    thread inside ``save()``, and a tuple is several times cheaper to construct.
    """

    key: str
    """Key path of its first occurrence, e.g. ``optim/state/0/exp_avg``."""
    tensor: torch.Tensor


_new_leaf: Callable[[tuple[str, torch.Tensor]], TensorLeaf] = functools.partial(tuple.__new__, TensorLeaf)
"""``_new_leaf((key, tensor))`` is ``TensorLeaf(key, tensor)`` without the generated Python
``__new__``: about 60 ns less per tensor, which ``flatten`` pays on the training thread."""


class FlatState:
    """A state split into its distinct tensors and a skeleton.

    ``leaf_tensors`` is ready when :func:`flatten` returns; ``skeleton``, ``keys`` and
    ``tensors`` may be built on first use (from a :class:`~asyncckpt._frame.Frame`), on whichever
    thread asks first, so ``save()`` spends no training time on them. Either way they describe
    the state as it was inside ``flatten``.
    """

    def __init__(self, skeleton: dict[str, Any], tensors: list[TensorLeaf]) -> None:
        self.leaf_tensors: list[torch.Tensor] = [leaf.tensor for leaf in tensors]
        """The distinct tensors, in first-seen order (detached where they required grad)."""
        self._frame: Frame | None = None
        self._skeleton, self._leaves = skeleton, tensors
        self._lock = threading.Lock()

    @classmethod
    def of_frame(cls, frame: Frame) -> FlatState:
        flat = cls.__new__(cls)
        flat.leaf_tensors, flat._frame, flat._lock = frame.tensors, frame, threading.Lock()
        return flat

    @property
    def skeleton(self) -> dict[str, Any]:
        self._describe()
        return self._skeleton

    @property
    def tensors(self) -> list[TensorLeaf]:
        """The distinct tensors with the key path of their first occurrence."""
        self._describe()
        return self._leaves

    @property
    def keys(self) -> list[str]:
        return [leaf.key for leaf in self.tensors]

    def _describe(self) -> None:
        with self._lock:
            if self._frame is not None:
                skeleton, keys = self._frame.described()
                self._skeleton = skeleton
                self._leaves = [_new_leaf(pair) for pair in zip(keys, self.leaf_tensors, strict=True)]
                self._frame = None


def flatten(state: object) -> FlatState:
    """Split ``state`` into a skeleton and its distinct tensors, with the cyclic GC paused.

    The common state is captured by :func:`asyncckpt._frame.capture` (its skeleton and keys are
    built on first use); a state it does not take is walked in full here, which also raises
    the errors.

    The walk allocates a few GC-tracked containers per tensor, and they live for the whole
    save, so in a process with a large heap it tends to cross the collector's thresholds: a
    gen-2 collection there took 175 ms where the walk itself takes 0.5 ms (a 320-tensor state
    beside 300k live dicts, on one CPU core). Paused here, that collection runs at the training
    thread's next allocation past the threshold instead, outside ``save()``. A collector the
    caller turned off stays off.

    Raises:
        TypeError: for any object asyncckpt cannot store, naming its key path and type.
    """
    collecting = gc.isenabled()
    if collecting:
        gc.disable()
    try:
        try:
            return FlatState.of_frame(capture(state))
        except Unusual:
            return _walk(state)
    finally:
        if collecting:
            gc.enable()


def _walk(state: object) -> FlatState:
    """The full walk: split any storable ``state`` into a skeleton and its distinct tensors, eagerly.

    Runs on the training thread inside ``save()`` for states :func:`asyncckpt._frame.capture`
    does not take (other scalar and key types, deep nesting, anything refused), so it is still
    written for speed: exact ints and dicts are tested first, and the subclass checks only after
    them. Which tensors are storable and which are one leaf, the limits and the error texts are
    :mod:`asyncckpt._walker`'s, as in the fast capture. Key paths are built as strings on the way
    down; error messages use them as they are.

    Raises:
        TypeError: for any object asyncckpt cannot store, naming its key path and type.
    """
    table = TensorTable()
    keys: list[str] = []
    # JSON characters the str and bytes values will take in the manifest (a lower bound for str:
    # escapes only add), so a state whose manifest load() would refuse is refused here instead.
    text_bytes = 0
    # Locals, not globals or attribute lookups, in the loops below.
    tensor_type, ordered_dict, container_tags, add_tensor = torch.Tensor, OrderedDict, CONTAINER_TAGS, table.add

    def visit(obj: object, where: str, depth: int) -> dict[str, Any]:
        # Before the tensor case: unflatten() refuses any node deeper than MAX_DEPTH, tensors included.
        if depth > MAX_DEPTH:
            raise TypeError(too_deep(where))
        if isinstance(obj, tensor_type):
            return {"t": "tensor", "id": tensor_id(obj, where)}
        kind = type(obj)
        if kind is int:  # ahead of the isinstance chain: optimizer param_groups list one per parameter
            return {"t": "int", "v": storable_int(obj, where)}  # type: ignore[arg-type]
        if kind is dict or kind is ordered_dict:
            return visit_dict(obj, kind, where, depth)  # type: ignore[arg-type]
        # bool before int: bool is a subclass of int.
        if isinstance(obj, bool):
            return {"t": "bool", "v": obj}
        if isinstance(obj, int):
            return {"t": "int", "v": storable_int(int(obj), where)}
        if isinstance(obj, float):
            return {"t": "float", "v": float_text(float(obj))}
        if isinstance(obj, str):
            value = str.__str__(obj)  # the value itself; str() of a (str, Enum) member is 'Color.RED'
            count_text(len(value), where)
            return {"t": "str", "v": value}
        if obj is None:
            return {"t": "none"}
        if isinstance(obj, (bytes, bytearray)):
            count_text((len(obj) + 2) // 3 * 4, where)  # base64, checked before it is built
            return {"t": "bytes", "v": base64.b64encode(bytes(obj)).decode("ascii")}
        if isinstance(obj, torch.dtype):
            name = dtype_name(obj)
            if name is None:
                raise TypeError(f"asyncckpt: cannot store dtype {obj} at {where or '<root>'!r}")
            return {"t": "dtype", "v": name}
        if isinstance(obj, torch.device):
            return {"t": "device", "v": str(obj)}
        if isinstance(obj, (list, tuple)):
            if isinstance(obj, torch.Size):
                tag = "size"
            elif kind is list or kind is tuple:
                tag = container_tags[kind]
            else:  # namedtuples and list subclasses would come back as another type
                raise TypeError(unsupported(obj, where))
            return {"t": tag, "items": [visit(v, join(where, str(i)), depth + 1) for i, v in enumerate(obj)]}
        raise TypeError(unsupported(obj, where))

    def count_text(size: int, where: str) -> None:
        nonlocal text_bytes
        text_bytes += size
        if text_bytes > MAX_MANIFEST_BYTES:
            raise TypeError(
                f"asyncckpt: the str and bytes values of this state take more than {MAX_MANIFEST_BYTES >> 20} MiB in "
                f"the manifest (passed at {where or '<root>'!r}), and load() refuses larger manifests; store large "
                "binary data as a uint8 tensor (torch.frombuffer(data, dtype=torch.uint8)) instead"
            )

    def visit_dict(obj: dict[Any, Any], kind: type, where: str, depth: int) -> dict[str, Any]:
        if obj and depth >= MAX_DEPTH:  # its keys and values would lie deeper than MAX_DEPTH
            raise TypeError(too_deep(where))
        items: list[list[dict[str, Any]]] = []
        append = items.append
        for key, value in obj.items():
            key_kind = type(key)
            # str and int keys (module and optimizer state dicts) take the short way.
            if key_kind is str:
                count_text(len(key), where)
                key_node, label = {"t": "str", "v": key}, key
            elif key_kind is int:
                key_node, label = {"t": "int", "v": storable_int(key, join(where, "<key>"))}, str(key)
            elif isinstance(key, (tensor_type, dict, list, tuple)):
                raise TypeError(f"asyncckpt: unsupported dict key {key!r} at {where or '<root>'!r}")
            else:
                key_node, label = visit(key, join(where, "<key>"), depth + 1), key_label(key)
            path = f"{where}/{label}" if where else label
            if isinstance(value, tensor_type):  # the common value: tensor_id() inlined
                index = add_tensor(value, path)
                if index == len(keys):
                    keys.append(path or "<root>")
                append([key_node, {"t": "tensor", "id": index}])
            else:
                append([key_node, visit(value, path, depth + 1)])
        return {"t": container_tags[kind], "items": items}

    def tensor_id(t: torch.Tensor, where: str) -> int:
        """The index of ``t`` among the leaves; a new leaf keeps ``where`` as its key."""
        index = add_tensor(t, where)
        if index == len(keys):
            keys.append(where or "<root>")
        return index

    skeleton = visit(state, "", 0)
    return FlatState(skeleton, [_new_leaf(pair) for pair in zip(keys, table.tensors, strict=True)])


def unflatten(skeleton: object, tensor_at: Callable[[int], torch.Tensor], where: str) -> Any:
    """Rebuild the state from a skeleton read from a (possibly hostile) manifest.

    ``tensor_at(i)`` returns the i-th tensor of the table (it validates ``i``). Only the node
    types listed in the module docstring are ever constructed.

    Raises:
        CorruptCheckpointError: for any malformed node, naming ``where``.
    """

    def bad(msg: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where}: malformed structure: {msg}")

    def build(node: object, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise bad(f"nested deeper than {MAX_DEPTH}")
        if not isinstance(node, dict) or not isinstance(node.get("t"), str):
            raise bad(f"expected a tagged node, got {type(node).__name__}")
        tag, value = node["t"], node.get("v")
        if tag in ("dict", "odict"):
            items = _items(node)
            out: dict[Any, Any] = OrderedDict() if tag == "odict" else {}
            for pair in items:
                if not (isinstance(pair, list) and len(pair) == 2):
                    raise bad("dict item is not a [key, value] pair")
                key = build(pair[0], depth + 1)
                try:
                    hash(key)  # a tuple key may hold a list
                except TypeError:
                    raise bad("unhashable dict key") from None
                if isinstance(key, torch.Tensor):
                    raise bad("tensor used as a dict key")
                out[key] = build(pair[1], depth + 1)
            return out
        if tag in ("list", "tuple", "size"):
            values = [build(v, depth + 1) for v in _items(node)]
            if tag == "list":
                return values
            if tag == "size":
                if not all(type(v) is int for v in values):
                    raise bad("torch.Size holds non-integers")
                return torch.Size(values)
            return tuple(values)
        if tag == "tensor":
            index = node.get("id")
            if type(index) is not int:
                raise bad("tensor node without an integer id")
            return tensor_at(index)
        return _scalar(tag, value, bad)

    def _items(node: dict[str, Any]) -> Sequence[object]:
        items = node.get("items")
        if not isinstance(items, list):
            raise bad(f"{node['t']} node without an items list")
        return items

    try:
        return build(skeleton, 0)
    except RecursionError as exc:
        raise bad("nesting too deep") from exc


def _scalar(tag: str, value: object, bad: Callable[[str], CorruptCheckpointError]) -> Any:
    if tag == "none":
        return None
    expected: dict[str, type] = {"bool": bool, "int": int, "str": str, "float": str, "bytes": str, "dtype": str,
                                 "device": str}  # fmt: skip
    if tag not in expected:
        raise bad(f"unknown node type {tag!r}")
    if type(value) is not expected[tag]:
        raise bad(f"{tag} node holds a {type(value).__name__}")
    assert isinstance(value, (bool, int, str))
    try:
        if tag == "float":
            return float_from_text(str(value))
        if tag == "bytes":
            return base64.b64decode(str(value), validate=True)
        if tag == "dtype":
            if value not in DTYPE_BY_NAME:
                raise bad(f"unknown dtype {value!r}")
            return DTYPE_BY_NAME[str(value)]
        if tag == "device":
            return torch.device(str(value))
    except (ValueError, OverflowError, binascii.Error, RuntimeError) as exc:
        raise bad(f"invalid {tag} value {value!r}: {exc}") from exc
    return value
