"""The shape of the package, read from the source with ``ast`` (function-level imports
included): no import cycle; the core imports neither the methods, the jobs nor the CLI; the
methods import neither the jobs nor the CLI; no private name crosses a module; imports inside
functions only where :mod:`lmcompress.compressor.util.lazy` says; files and functions short."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

import lmcompress
from lmcompress.compressor.util.lazy import DEFERRED, OPTIONAL

PACKAGE = Path(lmcompress.__file__).resolve().parent
CORE = ("lmcompress.compressor", "lmcompress.kernels", "lmcompress.evaluation")
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80


def _modules() -> dict[str, tuple[Path, bool]]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The module of ours ``name`` is (or is inside: ``package.module.attribute``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


class Import:
    def __init__(self, module: str, target: str, name: str | None, line: int, lazy: bool):
        self.module, self.target, self.name, self.line, self.lazy = module, target, name, line, lazy

    def __repr__(self) -> str:
        kind = "lazy " if self.lazy else ""
        return f"{self.module}:{self.line} {kind}import {self.target} ({self.name})"


def _imports() -> list[Import]:
    found = []
    for module, (path, is_package) in MODULES.items():
        tree = ast.parse(path.read_text())
        lazy = {
            id(node)
            for function in ast.walk(tree)
            if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
            for node in ast.walk(function)
        }
        base = module if is_package else module.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    found.append(Import(module, alias.name, None, node.lineno, id(node) in lazy))
            elif isinstance(node, ast.ImportFrom):
                source = node.module or ""
                if node.level:
                    parent = base.rsplit(".", node.level - 1)[0] if node.level > 1 else base
                    source = f"{parent}.{source}" if source else parent
                for alias in node.names:
                    full = f"{source}.{alias.name}"
                    target = full if full in MODULES else source
                    found.append(Import(module, target, alias.name, node.lineno, id(node) in lazy))
    return found


IMPORTS = _imports()


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for imp in IMPORTS:
        target = _resolve(imp.target) if imp.target.startswith("lmcompress") else None
        if target and target != imp.module:
            graph[imp.module].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph.get(node, ()):
                found.append(sorted(component))

    for node in sorted(set(graph) | {n for targets in graph.values() for n in targets}):
        if node not in index:
            visit(node)
    return found


def test_the_walk_sees_the_package():
    assert "lmcompress.jobs.run" in MODULES and "lmcompress.compressor.io.save" in MODULES
    assert any(i.lazy for i in IMPORTS) and any(not i.lazy for i in IMPORTS)
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


def test_no_import_cycle():
    assert _cycles(_graph()) == []


@pytest.mark.parametrize(
    "layer, forbidden",
    [
        (CORE, ("lmcompress.methods", "lmcompress.jobs", "lmcompress.cli", "lmcompress.api")),
        (("lmcompress.methods",), ("lmcompress.jobs", "lmcompress.cli", "lmcompress.api")),
        (("lmcompress.jobs",), ("lmcompress.cli",)),
    ],
)
def test_layers_import_only_downwards(layer, forbidden):
    wrong = [
        imp
        for imp in IMPORTS
        if imp.module.startswith(layer)
        and (imp.target == "lmcompress" or imp.target.startswith(forbidden))
    ]
    assert not wrong, wrong


def test_no_private_name_crosses_a_module():
    wrong = [
        imp
        for imp in IMPORTS
        if imp.target.startswith("lmcompress")
        and imp.name
        and imp.name.startswith("_")
        and not imp.name.startswith("__")
        and _resolve(imp.target) != imp.module
    ]
    assert not wrong, wrong


def _imports_optional_at_top(module: str) -> bool:
    return any(
        not imp.lazy and imp.target.split(".")[0] in OPTIONAL
        for imp in IMPORTS
        if imp.module == module
    )


def _deferred(imp: Import) -> bool:
    for rule in DEFERRED:
        importer, _, imported = rule.partition(" -> ")
        if imp.module != importer:
            continue
        if imp.target == imported or (
            imported.endswith("*") and imp.target.startswith(imported[:-1])
        ):
            return True
    return False


def test_lazy_imports_only_where_listed():
    wrong = [
        imp
        for imp in IMPORTS
        if imp.lazy
        and imp.target.split(".")[0] not in OPTIONAL
        and not (_resolve(imp.target) and _imports_optional_at_top(_resolve(imp.target)))
        and not _deferred(imp)
    ]
    assert not wrong, wrong


@pytest.mark.parametrize("module", sorted(MODULES))
def test_files_and_functions_are_short(module):
    path = MODULES[module][0]
    text = path.read_text()
    assert len(text.splitlines()) <= MAX_FILE_LINES, f"{path}: {len(text.splitlines())} lines"
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse(text))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, f"{path}: {long}"
