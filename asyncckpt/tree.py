"""Flatten a training state into tensors plus a typed-JSON skeleton, and back.

The skeleton is how a manifest records "the non-tensor structure of the state" without
pickle: every node is a small JSON object tagged with its Python type, so loading can
rebuild exactly the containers and scalars that were saved (int keys stay ints, tuples
stay tuples, ``nan`` stays ``nan``) and can never construct any other type.

Node forms (``t`` is the tag)::

    {"t": "dict" | "odict", "items": [[key_node, value_node], ...]}
    {"t": "list" | "tuple" | "size", "items": [node, ...]}
    {"t": "tensor", "id": <index into the manifest's tensor table>}
    {"t": "int", "v": 3}        {"t": "float", "v": "0x1.8p+1"}  (float.hex: exact, nan/inf too)
    {"t": "str", "v": "..."}    {"t": "bool", "v": true}          {"t": "none"}
    {"t": "bytes", "v": "<base64>"}   {"t": "dtype", "v": "bfloat16"}   {"t": "device", "v": "cuda:0"}

Both directions run on the calling thread and touch no tensor data.
"""

from __future__ import annotations

import base64
import binascii
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from .dtypes import DTYPE_BY_NAME, NAME_BY_DTYPE, dtype_name
from .errors import CorruptCheckpointError

MAX_DEPTH = 64
"""Deepest container nesting accepted on save and on load (state dicts nest 4-6 deep)."""


class TensorLeaf(NamedTuple):
    """One distinct tensor found in the state, in first-seen order.

    A NamedTuple rather than a dataclass: ``flatten`` builds one per tensor on the training
    thread inside ``save()``, and a tuple is several times cheaper to construct.
    """

    key: str
    """Key path of its first occurrence, e.g. ``optim/state/0/exp_avg``."""
    tensor: torch.Tensor


@dataclass(frozen=True)
class FlatState:
    skeleton: dict[str, Any]
    tensors: list[TensorLeaf]


def _key_label(key: object) -> str:
    return str(key) if isinstance(key, (str, int, bool, float)) or key is None else repr(key)


def _join(prefix: str, label: str) -> str:
    return f"{prefix}/{label}" if prefix else label


def flatten(state: object) -> FlatState:
    """Split ``state`` into a skeleton and its distinct tensors.

    Runs on the training thread inside ``save()``, so it is written for speed: about a
    microsecond per tensor (a 1B-parameter model with AdamW has ~300 tensors). Key paths are
    built as strings on the way down; error messages use them as they are.

    Raises:
        TypeError: for any object asyncckpt cannot store, naming its key path and type.
    """
    tensors: list[TensorLeaf] = []
    index_by_alias: dict[tuple[object, ...], int] = {}
    tensor_type, strided = torch.Tensor, torch.strided
    known_dtypes = NAME_BY_DTYPE

    def visit(obj: object, where: str, depth: int) -> dict[str, Any]:
        if isinstance(obj, tensor_type):
            return {"t": "tensor", "id": visit_tensor(obj, where)}
        if depth > MAX_DEPTH:
            raise TypeError(f"asyncckpt: state is nested deeper than {MAX_DEPTH} levels at {where or '<root>'!r}")
        kind = type(obj)
        if kind is dict or kind is OrderedDict:
            items = []
            for key, value in obj.items():  # type: ignore[attr-defined]
                key_kind = type(key)
                # str and int keys (module and optimizer state dicts) take the short way.
                if key_kind is str:
                    key_node, label = {"t": "str", "v": key}, key
                elif key_kind is int:
                    key_node, label = {"t": "int", "v": key}, str(key)
                elif isinstance(key, (tensor_type, dict, list, tuple)):
                    raise TypeError(f"asyncckpt: unsupported dict key {key!r} at {where or '<root>'!r}")
                else:
                    key_node, label = visit(key, _join(where, "<key>"), depth + 1), _key_label(key)
                items.append([key_node, visit(value, f"{where}/{label}" if where else label, depth + 1)])
            return {"t": "odict" if kind is OrderedDict else "dict", "items": items}
        # bool before int: bool is a subclass of int.
        if isinstance(obj, bool):
            return {"t": "bool", "v": obj}
        if isinstance(obj, int):
            return {"t": "int", "v": int(obj)}
        if isinstance(obj, float):
            return {"t": "float", "v": float(obj).hex()}
        if isinstance(obj, str):
            return {"t": "str", "v": str(obj)}
        if obj is None:
            return {"t": "none"}
        if isinstance(obj, (bytes, bytearray)):
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
                tag = kind.__name__
            else:  # namedtuples and list subclasses would come back as another type
                raise TypeError(_unsupported(obj, where or "<root>"))
            return {"t": tag, "items": [visit(v, _join(where, str(i)), depth + 1) for i, v in enumerate(obj)]}
        raise TypeError(_unsupported(obj, where or "<root>"))

    def visit_tensor(t: torch.Tensor, where: str) -> int:
        where = where or "<root>"
        if t.layout is not strided:
            raise TypeError(f"asyncckpt: cannot store {t.layout} tensor at {where!r}; convert it with .to_dense()")
        if t.dtype not in known_dtypes:  # quantized and bit-packed dtypes are not in the table
            raise TypeError(f"asyncckpt: cannot store a tensor of dtype {t.dtype} at {where!r}")
        is_cuda = t.is_cuda
        if not (is_cuda or t.is_cpu):
            if t.is_meta:
                raise TypeError(f"asyncckpt: tensor at {where!r} is on the meta device and has no data")
            raise TypeError(f"asyncckpt: tensor at {where!r} is on {t.device}; only cpu and cuda are supported")
        if t.numel() == 0:  # empty tensors share no data; never alias them
            tensors.append(TensorLeaf(where, t.detach() if t.requires_grad else t))
            return len(tensors) - 1
        # Two leaves are the same tensor if they are identical views of the same memory (tied
        # weights appear twice in a state_dict): stored once, restored as one object. CPU and
        # CUDA pointers never coincide (unified virtual addressing), nor do two GPUs'.
        alias = (t.data_ptr(), is_cuda, t.dtype, t.shape, t.stride())
        index = index_by_alias.get(alias)
        if index is None:
            index = index_by_alias[alias] = len(tensors)
            tensors.append(TensorLeaf(where, t.detach() if t.requires_grad else t))
        return index

    skeleton = visit(state, "", 0)
    return FlatState(skeleton=skeleton, tensors=tensors)


def _unsupported(obj: object, where: str) -> str:
    kind = f"{type(obj).__module__}.{type(obj).__qualname__}"
    return (
        f"asyncckpt: cannot store object of type {kind} at {where!r}. Supported: tensors, dict/OrderedDict, "
        "list/tuple, int, float, str, bool, None, bytes, torch.dtype, torch.device. Convert it (e.g. to a dict "
        "of tensors), or keep it out of the checkpointed state."
    )


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
            return float.fromhex(str(value))
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
