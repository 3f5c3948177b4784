"""What a training state may hold and how each value in it is visited: the one type dispatch of every state walk.

Three walks read a state, and this module decides for all of them:

- the fast capture on the training thread (:func:`asyncckpt._frame.capture`), which copies the
  containers now and leaves the skeleton for later;
- the full walk (:func:`asyncckpt._tree.flatten` when the capture declines), which stores every
  supported type and names the key path of anything it refuses;
- the DCP stager (:mod:`asyncckpt.integrations.dcp`), which copies a state dict's containers
  around staged tensors (:func:`map_state`).

It owns which exact types are containers and scalars and their skeleton tags
(:data:`CONTAINER_TAGS`, :data:`SCALAR_TAGS`, :func:`scalar_node`), which tensors can be stored
and the error that names one that cannot, when two tensors are one leaf (:class:`TensorTable`),
the limits ``load()`` enforces (:data:`MAX_DEPTH`, :data:`MAX_INT_BITS`), the bounds of the fast
path, and the text of key paths. The walks differ only in what they build and when.

Nothing here keeps state between calls; a :class:`TensorTable` belongs to one walk on one thread.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from ._dtypes import NAME_BY_DTYPE
from ._floats import float_text

MAX_DEPTH = 64
"""Deepest container nesting accepted on save and on load (state dicts nest 4-6 deep)."""

MAX_INT_BITS = 9600
"""Widest int stored (about 2,890 decimal digits): Python refuses to print or parse ints of more
than 4,300 digits, and the manifest holds ints as JSON numbers."""

FAST_INT = 1 << 64
"""The fast capture takes ints strictly inside +-2**64; wider ones go to the full walk, which checks them."""

LONG_STR = 4096
"""The fast capture takes str values of at most this length; the full walk counts the text a manifest can hold."""

CONTAINER_TAGS: dict[type, str] = {dict: "dict", OrderedDict: "odict", list: "list", tuple: "tuple"}
"""Exact container types and their skeleton tags. Subclasses (namedtuples, ``defaultdict``) are
refused, because they would load as another type; ``torch.Size`` is stored by the full walk as ``size``."""

SCALAR_TAGS: dict[type, str] = {int: "int", float: "float", str: "str", bool: "bool", type(None): "none"}
"""Exact scalar types and their skeleton tags: what the fast capture takes as a value."""


def scalar_node(value: object) -> dict[str, Any]:
    """The skeleton node of a value whose exact type is in :data:`SCALAR_TAGS` (floats exact, NaN bits too)."""
    kind = type(value)
    if kind is float:
        return {"t": "float", "v": float_text(value)}  # type: ignore[arg-type]
    if value is None:
        return {"t": "none"}
    return {"t": SCALAR_TAGS[kind], "v": value}


class TensorTable:
    """The distinct tensors of a state in first-seen order, and which leaf each tensor object is.

    Two tensors are one leaf if they are identical views of the same memory (tied weights appear
    twice in a state_dict): stored once, restored as one object. Views that differ in dtype,
    shape, stride or in the lazy conjugate and negative bits (``z.conj()`` and ``z.conj().imag``
    share ``z``'s memory but not its values) are distinct leaves, and so is every empty tensor
    (no memory to share). CPU and CUDA pointers never coincide (unified virtual addressing), nor
    do two GPUs'; the device kind is in the key all the same.

    Aliasing is decided in two steps, because the full key (data pointer, device kind, dtype,
    shape, stride, conj and neg bits) costs several more attribute reads and a tuple per tensor,
    while nearly every tensor has an address of its own: ``by_ptr`` holds the first leaf at each
    address, and only a later tensor at a known address builds full keys. Each tensor's layout,
    dtype, device kind, nestedness, element count, data pointer and requires_grad are read once.

    Used by one walk on one thread (the training thread inside ``save()``).
    """

    __slots__ = ("by_alias", "by_ptr", "tensors")

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        """The distinct tensors in first-seen order, detached where they required grad."""
        self.by_ptr: dict[int, int] = {}
        self.by_alias: dict[tuple[object, ...], int] = {}

    def add(self, t: torch.Tensor, where: str) -> int:
        """The leaf index of ``t``, appended unless it is an identical view of an earlier leaf.

        Raises:
            TypeError: ``t`` cannot be stored; the message names ``where`` and says what to do.
        """
        if not (
            t.layout is torch.strided
            and t.dtype in NAME_BY_DTYPE
            and (t.is_cuda or t.is_cpu)
            and not t.is_nested
            and t.numel()
            and (ptr := t.data_ptr())
        ):
            ptr = _storable_pointer(t, where)
            if not ptr:
                return self._append(t)
        first = self.by_ptr.get(ptr)
        if first is None:
            self.by_ptr[ptr] = len(self.tensors)
            return self._append(t)
        return self._alias(t, ptr, first)

    def add_common(self, occurrences: list[torch.Tensor]) -> dict[int, int] | None:
        """``id()`` of each tensor object in ``occurrences`` (in walk order) -> its leaf index.

        Only for the common case: every tensor storable, non-empty and with memory. One empty
        tensor object met twice is two leaves, which one index per object cannot say. None if
        any tensor is not common; the table is then in an unspecified state, to be dropped.
        """
        tensors, by_ptr = self.tensors, self.by_ptr
        index_of: dict[int, int] = {}
        # Locals, not globals or attribute lookups, in the loop: it runs once per tensor in save().
        strided, known_dtypes = torch.strided, NAME_BY_DTYPE
        for t in occurrences:
            if not (
                t.layout is strided
                and t.dtype in known_dtypes
                and (t.is_cuda or t.is_cpu)
                and not t.is_nested
                and t.numel()
                and (ptr := t.data_ptr())
            ):
                return None
            if ptr not in by_ptr:
                by_ptr[ptr] = index_of[id(t)] = len(tensors)
                tensors.append(t.detach() if t.requires_grad else t)
            else:
                index_of[id(t)] = self._alias(t, ptr, by_ptr[ptr])
        return index_of

    def _append(self, t: torch.Tensor) -> int:
        self.tensors.append(t.detach() if t.requires_grad else t)
        return len(self.tensors) - 1

    def _alias(self, t: torch.Tensor, ptr: int, first: int) -> int:
        """The leaf of non-empty ``t`` at the address ``ptr`` of the earlier leaf ``first``.

        ``first`` gets its full key here, at the first collision; every other non-empty leaf at
        this address came through here and has its key already.
        """
        seen = self.tensors[first]
        self.by_alias.setdefault(
            (ptr, seen.is_cuda, seen.dtype, seen.shape, seen.stride(), seen.is_conj(), seen.is_neg()), first
        )
        key = (ptr, t.is_cuda, t.dtype, t.shape, t.stride(), t.is_conj(), t.is_neg())
        index = self.by_alias.get(key)
        if index is None:
            index = self.by_alias[key] = self._append(t)
        return index


def _storable_pointer(t: torch.Tensor, where: str) -> int:
    """The data pointer of ``t``, 0 if it is empty (empty tensors are never aliased, nor their pointer read).

    Raises:
        TypeError: ``t`` cannot be stored, naming ``where``.
    """
    where = where or "<root>"
    if t.layout is not torch.strided:
        raise TypeError(f"asyncckpt: cannot store {t.layout} tensor at {where!r}; convert it with .to_dense()")
    if t.is_nested:  # strided layout, but no single shape: staging it fails only later
        raise TypeError(f"asyncckpt: cannot store a nested tensor at {where!r}; store its components "
                        "(list(t.unbind())) or a padded tensor (t.to_padded_tensor(0.0)) instead")  # fmt: skip
    if t.dtype not in NAME_BY_DTYPE:  # quantized and bit-packed dtypes are not in the table
        raise TypeError(f"asyncckpt: cannot store a tensor of dtype {t.dtype} at {where!r}")
    if not (t.is_cuda or t.is_cpu):
        if t.is_meta:
            raise TypeError(f"asyncckpt: tensor at {where!r} is on the meta device and has no data")
        raise TypeError(f"asyncckpt: tensor at {where!r} is on {t.device}; only cpu and cuda are supported")
    if t.numel() == 0:
        return 0
    ptr: int = t.data_ptr()
    if not ptr:  # copying from it would read address 0: a crash, not an error
        raise TypeError(
            f"asyncckpt: tensor at {where!r} has {t.numel()} elements but no memory (its storage was freed, "
            "as FSDP frees unsharded parameters); save the state while its storage is allocated"
        )
    return ptr


def storable_int(value: int, where: str) -> int:
    """``value``, if the manifest can hold it.

    Raises:
        TypeError: wider than :data:`MAX_INT_BITS`, naming ``where``.
    """
    if value.bit_length() > MAX_INT_BITS:
        raise TypeError(
            f"asyncckpt: cannot store an int of {value.bit_length()} bits at {where or '<root>'!r} (at most "
            f"{MAX_INT_BITS}: the manifest holds ints as JSON numbers); store it as a string or bytes"
        )
    return value


def too_deep(where: str) -> str:
    """The error for a value nested deeper than :data:`MAX_DEPTH` at ``where``."""
    return (f"asyncckpt: state is nested deeper than {MAX_DEPTH} levels at {where or '<root>'!r} (load() refuses "
            "deeper structures); flatten that part of the state")  # fmt: skip


def unsupported(obj: object, where: str) -> str:
    """The error for a value of a type no walk stores."""
    kind = f"{type(obj).__module__}.{type(obj).__qualname__}"
    return (
        f"asyncckpt: cannot store object of type {kind} at {where or '<root>'!r}. Supported: tensors, "
        "dict/OrderedDict, list/tuple, int, float, str, bool, None, bytes, torch.dtype, torch.device. Convert it "
        "(e.g. to a dict of tensors), or keep it out of the checkpointed state."
    )


def key_label(key: object) -> str:
    """A dict key's text in key paths: the base value's, so an Enum key reads as its value."""
    if isinstance(key, bool) or key is None:
        return str(key)
    if isinstance(key, int):
        return int.__repr__(key)
    if isinstance(key, float):
        return float.__repr__(key)
    if isinstance(key, str):
        return str.__str__(key)
    return repr(key)


def join(prefix: str, label: str) -> str:
    """The key path of ``label`` under ``prefix`` (``""`` is the root)."""
    return f"{prefix}/{label}" if prefix else label


def map_state(value: Any, leaf: Callable[[Any, str], Any], where: str = "") -> Any:
    """A copy of ``value``'s containers with ``leaf(v, key path)`` in place of every other value ``v``.

    The DCP stager's walk: dicts of any dict type come back as plain dicts (as DCP's own state
    dicts are), exact lists and tuples as lists and tuples; everything else, tensors and
    namedtuples included, is a leaf. No depth limit or type check: DCP stores what it is given.
    Runs on the calling thread.
    """
    if isinstance(value, dict):
        return {k: map_state(v, leaf, join(where, str(k))) for k, v in value.items()}
    kind = type(value)
    if kind is list or kind is tuple:
        items = [map_state(v, leaf, join(where, str(i))) for i, v in enumerate(value)]
        return items if kind is list else tuple(items)
    return leaf(value, where)
