"""Property: any consistently rewritten (resealed) manifest is refused by load() and verify() alike, or loads.

Hypothesis replaces one to three values anywhere in a small checkpoint's manifest with another JSON value
and reseals it, as someone with write access could. Whatever the change, ``load`` and ``verify``
raise only CheckpointError (never TypeError, KeyError, MemoryError, ...), and ``verify`` refuses
every manifest that ``load`` refuses as corrupt.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st
from property_states import PROFILE

import asyncckpt
from asyncckpt._manifest import MANIFEST_NAME
from asyncckpt._manifest_digest import DIGEST_FIELD, seal

_STATE = {"model": {"w": torch.linspace(-1, 1, 64), "b": torch.arange(3, dtype=torch.int16), "e": torch.empty(0)},
          "lr": 0.5, "name": "x", "ids": (1, [2, None]), "raw": b"\x00\x01", "dtype": torch.bfloat16}  # fmt: skip

_NAMES = ["cpu", "cuda:0", "zstd", "none", "lz4", "crc32", "float32", "uint8", "data-0.bin", "tensor", "dict",
          "list", "float", "nan", "-0x1p+0"]  # fmt: skip
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(1 << 70), 1 << 70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
    st.sampled_from(_NAMES),
)
json_values = st.recursive(
    _SCALARS,
    lambda children: st.one_of(
        st.lists(children, max_size=3), st.dictionaries(st.text(max_size=4), children, max_size=3)
    ),
    max_leaves=6,
)


assert PROFILE in ("ci", "nightly"), "property_states loads the example-count profiles"


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in the document a value can be replaced at."""
    found = [prefix] if prefix else []
    if isinstance(node, dict):
        for key, value in node.items():
            found += _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found += _paths(value, (*prefix, i))
    return found


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("hostile")
    with asyncckpt.AsyncCheckpointer(root / "run", codec="zstd") as ckpt:
        path = ckpt.save(1, _STATE).result().path
    assert path is not None
    doc = json.loads((path / MANIFEST_NAME).read_bytes())
    del doc[DIGEST_FIELD]
    return path, doc


def _outcome(check: Any, path: Path) -> str:
    try:
        check(path)
    except asyncckpt.CorruptCheckpointError:
        return "corrupt"
    except asyncckpt.CheckpointError:
        return "refused"
    return "ok"


@given(data=st.data())
def test_replaced_values_are_refused_by_both_or_load(
    original: tuple[Path, dict[str, Any]], data: st.DataObject
) -> None:
    source, doc = original
    doc = json.loads(json.dumps(doc))
    changes = []
    for _ in range(data.draw(st.integers(1, 3), label="changes")):
        where = data.draw(st.sampled_from(_paths(doc)), label="path")
        replacement = data.draw(json_values, label="value")
        node = doc
        for key in where[:-1]:
            node = node[key]
        node[where[-1]] = replacement
        changes.append((where, replacement))
    with tempfile.TemporaryDirectory(prefix="asyncckpt-hostile-") as tmp:
        checkpoint = Path(tmp) / "ckpt"
        checkpoint.mkdir()
        (checkpoint / "data-0.bin").write_bytes((source / "data-0.bin").read_bytes())
        (checkpoint / MANIFEST_NAME).write_bytes(seal(doc))
        loaded, verified = _outcome(asyncckpt.load, checkpoint), _outcome(asyncckpt.verify, checkpoint)
    event(f"load {loaded}, verify {verified}")
    assert not (loaded == "corrupt" and verified == "ok"), f"verify passes what load refuses: {changes}"
