"""The shape of ``benchmarks/``, read from the source with ``ast``: files and functions short,
imports inside functions only of the optional dependencies (and the few modules listed below,
with why), and drivers that import neither torch nor the library's heavy modules, so that their
``--help`` and ``--render-only`` stay cheap (the model work is in ``benchmarks/child/``)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import benchmarks
from benchmarks import BENCHMARKS
from benchmarks.table import table_names

ROOT = Path(benchmarks.__file__).resolve().parent
FILES = sorted(ROOT.rglob("*.py"))
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80
OPTIONAL = ("matplotlib", "triton", "torchao", "sklearn", "lm_eval")
LAZY = {  # (module, import) -> why it is inside a function
    ("benchmarks.plots", "torch"): "int8's bias heatmap takes tensors: only the PNG needs torch",
    ("benchmarks.plots", "lmcompress.methods.int8.bias_plot"): "the PNG (matplotlib)",
    ("benchmarks.kernels", "lmcompress.kernels"): "Triton: once TRITON_INTERPRET is set",
    ("benchmarks.kernels", "benchmarks.kernels_sweep"): "imports Triton (the library), likewise",
    ("benchmarks.kernels_sweep", "lmcompress.kernels.nm_linear_triton"): "Triton, likewise",
    ("benchmarks.tamperings", "safetensors.torch"): "the edits' torch, in their own process",
}
TORCH_AT_THE_TOP = {
    "int8_speed": "measured in the driver's own process",
    "int4_speed": "measured in the driver's own process",
    "subnet_digits": "measured in the driver's own process",
    "layer_speed": "measured in the driver's own process",
    "load_checks": "measured in the driver's own process",
    "learned_speed": "measured in the driver's own process",
    "kernels": "measured in the driver's own process",
    "head_loss_speed": "measured in the driver's own process",
}


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)


def _lazy_imports(path: Path) -> list[tuple[str, str, int]]:
    tree = ast.parse(path.read_text())
    found = []
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(function):
            if isinstance(node, ast.Import):
                found += [(_module(path), alias.name, node.lineno) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                found.append((_module(path), node.module or "", node.lineno))
    return found


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_files_and_functions_are_short(path):
    text = path.read_text()
    assert len(text.splitlines()) <= MAX_FILE_LINES
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            assert lines <= MAX_FUNCTION_LINES, f"{node.name}: {lines} lines"


def test_imports_inside_functions_only_where_listed():
    wrong = [
        (module, target, line)
        for path in FILES
        for module, target, line in _lazy_imports(path)
        if target.split(".")[0] not in OPTIONAL and (module, target) not in LAZY
    ]
    assert not wrong, wrong


def test_drivers_import_no_torch():
    drivers = [f"benchmarks.{name}" for name in BENCHMARKS if name not in TORCH_AT_THE_TOP]
    drivers += ["benchmarks.sweep", *(f"benchmarks.{name}" for name in table_names())]
    code = f"import sys; import {', '.join(drivers)}; print(sorted(m for m in sys.modules if "
    code += "m == 'torch' or m == 'transformers'))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def _imports_of_ours(path: Path) -> set[str]:
    """The ``benchmarks`` modules ``path`` imports, at the top or inside functions (not those
    under ``if TYPE_CHECKING:``, which never run)."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and ast.unparse(block.test).endswith("TYPE_CHECKING")
        for node in ast.walk(block)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        found |= {name for name in names if name in MODULES}
    return found - {_module(path)}


MODULES = {_module(path).removesuffix(".__init__") for path in FILES}


def _reaches(graph: dict[str, set[str]], start: str, goal: str) -> bool:
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        if node == goal:
            return True
        if node not in seen:
            seen.add(node)
            todo += graph.get(node, ())
    return False


def test_no_import_cycle_between_benchmark_modules():
    """(kernels and kernels_sweep imported each other: the sweep now takes its plan.)"""
    graph = {_module(path).removesuffix(".__init__"): _imports_of_ours(path) for path in FILES}
    cycles = sorted(
        (module, other)
        for module, targets in graph.items()
        for other in targets
        if _reaches(graph, other, module)
    )
    assert not cycles, cycles
    assert _reaches({"a": {"b"}, "b": {"a"}}, "b", "a")  # the walk itself sees a cycle
