"""The package's import graph: every module imports on its own, and no two modules import each other.

The graph counts every ``import`` inside ``asyncckpt/``, at module level or inside a function
(a lazy import is still a dependency: the two modules cannot be read, changed or tested apart).
An import of a package (``from ..codecs import x``) is an edge to its ``__init__``; an import of a
submodule (``from ..codecs.base import x``) is an edge to that submodule.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "asyncckpt"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)] if node.level else []
                target = ".".join([*base, *([node.module] if node.module else [])])
                for alias in node.names:
                    edges.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in modules else target)
            elif isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names)
        graph[name] = {e for e in edges if e in modules and e != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_two_modules_import_each_other() -> None:
    graph = import_graph()
    assert len(graph) > 50 and "asyncckpt._gpu.pipeline" in graph["asyncckpt._gpu.staging"] | graph[
        "asyncckpt._gpu.pipeline"
    ] | {"asyncckpt._gpu.pipeline"}
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_module_imports_in_a_fresh_interpreter() -> None:
    names = sorted(n for n in import_graph() if not n.endswith("__main__"))
    code = (
        "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\nprint(len(sys.argv) - 1)"
    )
    proc = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True, cwd=REPO,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(len(names))


def test_loading_imports_only_the_codecs_the_checkpoint_names(tmp_path: Path) -> None:
    script = f"""
import sys, torch, asyncckpt
with asyncckpt.AsyncCheckpointer({str(tmp_path)!r}, codec="zstd") as ckpt:
    ckpt.save(1, {{"w": torch.randn(4096)}}).result(60)
asyncckpt.load({str(tmp_path)!r})
print(sorted(m for m in sys.modules if m.startswith(("asyncckpt._codecs.", "asyncckpt._gpu.decoders"))))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=REPO)
    assert "lz4" not in out.stdout and "deflate" not in out.stdout and "gpu.decoders" not in out.stdout, out.stdout


PUBLIC = {
    "asyncckpt", "asyncckpt.__main__", "asyncckpt.cli", "asyncckpt.errors", "asyncckpt.metrics",
    "asyncckpt.metrics_exporter", "asyncckpt.observer", "asyncckpt.options", "asyncckpt.result",
    "asyncckpt.distributed", "asyncckpt.integrations", "asyncckpt.integrations.dcp",
    "asyncckpt.integrations.huggingface", "asyncckpt.integrations.lightning", "asyncckpt.testing",
    "asyncckpt.testing.demo_model", "asyncckpt.testing.state_compare",
}  # fmt: skip
"""The documented API (CONTRIBUTING.md, "Map"); every other module is named ``_*`` somewhere in its path."""


def test_every_undocumented_module_is_marked_private() -> None:
    names = {module_name(p) for p in PACKAGE.rglob("*.py")}
    unmarked = sorted(n for n in names - PUBLIC if not any(part.startswith("_") for part in n.split(".")[1:]))
    assert not unmarked, f"internal modules without a leading underscore (rename them, or document them): {unmarked}"
    assert names >= PUBLIC, f"documented modules that do not exist: {sorted(PUBLIC - names)}"
