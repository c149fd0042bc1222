"""The shape of the package, read from the source with ``ast`` (function-level imports
included): every module sits in exactly one layer of :data:`LAYERS` and imports only from its
own layer entry or from lower ones; no import cycle between modules, between layer entries or
between the top-level packages; no private name crosses a module; imports inside functions only
where :mod:`lmcompress.compressor.util.lazy` says; files and functions short."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

import lmcompress
from lmcompress.compressor.util.lazy import DEFERRED, OPTIONAL

PACKAGE = Path(lmcompress.__file__).resolve().parent
# The layers, bottom to top. An entry is one module (``lmcompress.compressor.report``) or a
# package with everything in it (``lmcompress.kernels.*``). A module imports from its own entry
# or from an entry in a lower layer; the entries of one layer (a tuple of several) do not import
# each other. The compressor's own modules are entries of their own: ``compressor/method.py``
# sits above the sub-packages whose modules import ``compressor/report.py``.
LAYERS: list[tuple[str, ...]] = [
    ("lmcompress.version", "lmcompress.errors", "lmcompress.cache"),  # leaves
    ("lmcompress.kernels.*",),  # the reference ops and their kernels: no model, no method
    ("lmcompress.compressor.util.*",),  # files, memory, progress, the lazy-import list
    ("lmcompress.compressor.options", "lmcompress.compressor.report"),
    ("lmcompress.compressor.config",),
    ("lmcompress.compressor.sparsity",),
    ("lmcompress.compressor.model.*",),
    ("lmcompress.compressor.lean_cache",),  # KV buffers that grow in place (the lean step's)
    ("lmcompress.compressor.formats.*",),
    ("lmcompress.compressor.lean_decode",),  # a decode step over any format's layers
    ("lmcompress.compressor.io.*",),  # the output directory, save, load, model card
    ("lmcompress.compressor.calibration.*",),
    ("lmcompress.compressor.method",),
    ("lmcompress.compressor.training.*",),  # receives its scoring functions as arguments
    ("lmcompress.evaluation.*",),  # perplexity, corpora, lm-eval, speed
    ("lmcompress.methods.common",),
    ("lmcompress.methods.obs", "lmcompress.methods.layerwise"),  # shared by the calibrated methods
    ("lmcompress.methods.pruning",),
    (
        "lmcompress.methods.magnitude.*",
        "lmcompress.methods.wanda.*",
        "lmcompress.methods.sparsegpt.*",
        "lmcompress.methods.svd.*",
        "lmcompress.methods.int8.*",
        "lmcompress.methods.gptq.*",
        "lmcompress.methods.structured.*",
    ),
    ("lmcompress.methods.priors",),  # the one-shot masks the learned methods start from
    ("lmcompress.methods.maskllm.*", "lmcompress.methods.subnet.*"),
    ("lmcompress.methods",),  # the registry
    ("lmcompress.jobs.*",),
    ("lmcompress.cli.*", "lmcompress.api"),  # the two front ends
    ("lmcompress",),  # the public names, imported on first use
]
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


def _in_entry(module: str, entry: str) -> bool:
    if entry.endswith(".*"):
        package = entry[:-2]
        return module == package or module.startswith(package + ".")
    return module == entry


def _empty_package(module: str) -> bool:
    """A package's ``__init__`` that holds no code: a directory, not a module of any layer."""
    path, is_package = MODULES[module]
    return is_package and not ast.parse(path.read_text()).body


def _entries_of(module: str) -> list[tuple[int, str]]:
    return [
        (rank, entry)
        for rank, layer in enumerate(LAYERS)
        for entry in layer
        if _in_entry(module, entry)
    ]


def _entry(module: str) -> tuple[int, str]:
    (found,) = _entries_of(module)
    return found


def _upward(imports: list[Import]) -> list[str]:
    """Every import of one of our modules from a higher layer, or from another entry of the
    importer's own layer."""
    wrong = []
    for imp in imports:
        target = _resolve(imp.target) if imp.target.startswith("lmcompress") else None
        if target is None or target == imp.module or _empty_package(target):
            continue
        (rank, entry), (target_rank, target_entry) = _entry(imp.module), _entry(target)
        if target_rank > rank or (target_rank == rank and target_entry != entry):
            wrong.append(f"{imp!r}: layer {rank} {entry} -> layer {target_rank} {target_entry}")
    return wrong


def _collapsed(graph: dict[str, set[str]], node_of) -> dict[str, set[str]]:
    """``graph`` with every module replaced by ``node_of(module)`` (edges inside one dropped)."""
    collapsed: dict[str, set[str]] = defaultdict(set)
    for module, targets in graph.items():
        for target in targets:
            if node_of(module) != node_of(target):
                collapsed[node_of(module)].add(node_of(target))
    return collapsed


def _top_package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_the_walk_sees_the_package():
    assert "lmcompress.jobs.run" in MODULES and "lmcompress.compressor.io.save" in MODULES
    assert any(i.lazy for i in IMPORTS) and any(not i.lazy for i in IMPORTS)
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


def test_no_import_cycle():
    assert _cycles(_graph()) == []


def test_every_module_is_in_exactly_one_layer():
    entries = [entry for layer in LAYERS for entry in layer]
    assert len(entries) == len(set(entries)), "an entry listed twice"
    wrong = {
        module: [entry for _, entry in _entries_of(module)]
        for module in MODULES
        if not _empty_package(module) and len(_entries_of(module)) != 1
    }
    assert not wrong, wrong
    unused = [e for e in entries if not any(_in_entry(m, e) for m in MODULES)]
    assert not unused, f"entries that name no module: {unused}"


def test_the_layer_check_sees_an_upward_import():
    up = Import("lmcompress.compressor.io.model_card", "lmcompress.evaluation.speed", None, 1, True)
    side = Import(
        "lmcompress.methods.subnet.learning", "lmcompress.methods.maskllm", None, 2, False
    )
    down = Import("lmcompress.evaluation.speed", "lmcompress.compressor.io.load", None, 3, False)
    root = Import("lmcompress.jobs.run", "lmcompress", "run", 4, False)
    assert len(_upward([up, side, down, root])) == 3
    assert "lmcompress.compressor.io.load" not in " ".join(_upward([up, side, down, root]))


def test_layers_import_only_downwards():
    wrong = _upward(IMPORTS)
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(
    "granularity", ["layer entry", "top-level package"], ids=["entries", "packages"]
)
def test_no_cycle_between_packages(granularity):
    node_of = (lambda m: _entry(m)[1]) if granularity == "layer entry" else _top_package
    graph = {m: {t for t in ts if not _empty_package(t)} for m, ts in _graph().items()}
    cycles = _cycles(_collapsed(graph, node_of))
    assert not cycles, cycles


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
