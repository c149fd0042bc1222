"""No method imports the API or the method registry (``lmcompress.methods`` itself): a method
that needs another method's math imports that math module (``methods.wanda.scores``), never the
machinery that runs methods by name. Read from the source (ast), so a lazy import inside a
function counts too."""

import ast
from pathlib import Path

import pytest

import lmcompress

PACKAGE = Path(lmcompress.__file__).resolve().parent
METHODS = PACKAGE / "methods"
# names ``lmcompress`` exports lazily from the API or the registry
FORBIDDEN_TOP_LEVEL = {"api", "methods", "compress", "METHODS"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _is_submodule(name: str) -> bool:
    """``from lmcompress.methods import common``: a module of the package, not its registry."""
    return (METHODS / f"{name}.py").is_file() or (METHODS / name / "__init__.py").is_file()


def forbidden_imports(source: str, module: str, is_package: bool = False) -> list[str]:
    """The imports in ``source`` (the code of ``module``) of the API or the registry."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in ("lmcompress.api", "lmcompress.methods") or alias.name.startswith(
                    "lmcompress.api."
                ):
                    found.append(f"import {alias.name}")
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(node, module, is_package)
            names = {alias.name for alias in node.names}
            if target == "lmcompress.api" or target.startswith("lmcompress.api."):
                found.append(f"from {target} import {', '.join(sorted(names))}")
            elif target == "lmcompress.methods" and not all(map(_is_submodule, names)):
                found.append(f"from {target} import {', '.join(sorted(names))}")  # the registry
            elif target == "lmcompress" and names & FORBIDDEN_TOP_LEVEL:
                found.append(f"from lmcompress import {', '.join(sorted(names))}")
    return found


def _method_modules() -> list[Path]:
    return sorted(p for p in METHODS.rglob("*.py") if p != METHODS / "__init__.py")


def test_the_walk_sees_every_method():
    names = {_module_name(p) for p in _method_modules()}
    for method in ("magnitude", "wanda", "sparsegpt", "maskllm", "subnet"):
        assert f"lmcompress.methods.{method}.method" in names
    assert "lmcompress.methods.priors" in names


@pytest.mark.parametrize("path", _method_modules(), ids=lambda p: str(p.relative_to(METHODS)))
def test_no_method_imports_the_api_or_the_registry(path):
    found = forbidden_imports(
        path.read_text(), _module_name(path), is_package=path.name == "__init__.py"
    )
    assert not found, f"{path.relative_to(PACKAGE.parent)}: {found}"


@pytest.mark.parametrize(
    "source",
    [
        "from lmcompress.api import compress",
        "import lmcompress.api",
        "def f():\n    from lmcompress.methods import get_method",
        "from lmcompress import compress",
        "import lmcompress.methods",
        "from ... import api",
        "from ...methods import METHODS",
    ],
)
def test_the_check_catches_each_form(source):
    assert forbidden_imports(source, "lmcompress.methods.maskllm.transfer")


@pytest.mark.parametrize(
    "source",
    [
        "from lmcompress.methods.wanda.scores import wanda_mask",
        "from lmcompress.methods.common import prune_layer_",
        "import lmcompress.methods.sparsegpt.solver",
        "from lmcompress.compressor.calibration.layerwise import compress_layerwise",
        "from .masks import hard_mask",
        "from .. import common",
    ],
)
def test_the_check_allows_other_methods_math(source):
    assert not forbidden_imports(source, "lmcompress.methods.maskllm.transfer")
