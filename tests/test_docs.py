"""The docs site (``mkdocs.yml``, ``docs/``): it builds with ``--strict``, every page is in the
nav, every repository path a page names exists, every measured number comes from a results
file, and the generated references cover the whole CLI and the whole public API.

``scripts/setup.sh`` installs the ``docs`` extra, so nothing here is skipped: a missing mkdocs
is a failure, as a broken page is.
"""

import html
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import lmcompress
from lmcompress.cli.main import COMMANDS
from lmcompress.methods import METHODS

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
# `a/b.py`-like inline code: no spaces, a slash, a file extension the repository holds
REPO_PATH = re.compile(r"`([^`\s]+/[^`\s]*\.(?:py|md|yaml|json|png|sh))`")


def nav_pages(entries) -> list[str]:
    """Every page ``mkdocs.yml``'s nav lists (nested sections included)."""
    pages = []
    for entry in entries:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_site_builds_strict(tmp_path):
    """The whole site, as CI and a reader build it: a broken link, an unknown nav page, an API
    object that does not resolve or a docstring mkdocstrings cannot parse fails the build."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    for page in PAGES:
        built = tmp_path / page.relative_to(DOCS).with_suffix("") / "index.html"
        if page.name == "index.md":
            built = tmp_path / page.relative_to(DOCS).parent / "index.html"
        assert built.is_file(), built
    cli = (tmp_path / "cli" / "index.html").read_text()
    assert "cli-reference" not in cli  # the placeholder was replaced
    assert "--blocksize" in cli and "usage: compress-model bench" in cli
    check_api_page((tmp_path / "api" / "index.html").read_text())


def check_api_page(page: str) -> None:
    """What docs/hooks/griffe_docs.py and the mkdocstrings options promise: no literal Sphinx
    role, no raw ``field(...)`` default, a base's members once, roles as working links."""
    text = html.unescape(re.sub(r"<[^>]+>", "", page))
    assert not re.findall(r":(?:class|func|meth|mod|data|attr|exc):`", text)
    assert "field(" not in text and "metadata=" not in text
    # to_dict is defined by MethodConfig and CompressionReport: a heading and a signature each
    assert len(re.findall(r"^to_dict\(\)", text, re.MULTILINE)) == 2
    assert 'href="#lmcompress.errors.ModelLoadError"' in page  # a role became a link
    assert "nsamples: int = 128" in text and "calibration windows" in text  # a field, readably
    for group in ("TrainingOptions", "LearningScope"):
        assert f'id="lmcompress.compressor.training.options.{group}"' in page


def test_every_page_is_in_the_nav():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    listed = nav_pages(config["nav"])
    assert len(listed) == len(set(listed)), "a page is listed twice"
    assert sorted(listed) == sorted(str(p.relative_to(DOCS)) for p in PAGES)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_repository_paths_named_in_the_docs_exist(page):
    named = set(REPO_PATH.findall(page.read_text()))
    missing = sorted(path for path in named if not (ROOT / path).exists())
    assert not missing, f"{page.relative_to(ROOT)} names paths that do not exist: {missing}"


def test_every_measured_number_is_in_a_results_file():
    """``scripts/check_numbers.py``: each decimal or thousands-separated number outside code
    appears in the text of a file under ``benchmarks/results/``."""
    command = [sys.executable, str(ROOT / "scripts" / "check_numbers.py"), *map(str, PAGES)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


def test_api_page_documents_every_public_name():
    directives = re.findall(r"^::: ([\w.]+)$", (DOCS / "api.md").read_text(), re.MULTILINE)
    documented = {path.rsplit(".", 1)[-1] for path in directives}
    assert set(lmcompress.__all__) <= documented


def test_cli_reference_has_every_command_and_method_option():
    path = DOCS / "hooks" / "cli_reference.py"
    spec = importlib.util.spec_from_file_location("cli_reference", path)
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    page = hook.cli_reference()
    for name in METHODS:
        assert f"### `--method {name}`" in page
    for name in COMMANDS:
        assert f"usage: compress-model {name}" in page
    for flag in ("--blocksize", "--percdamp", "--update-weights", "--hessian-dtype", "--ratio"):
        assert flag in page
    assert "--runtime {packed,dense,expanded}" in page


def test_tested_versions_are_what_the_set_up_installed():
    """``docs/install.md``'s table is written by ``scripts/setup.sh`` (through
    ``scripts/tested_versions.py``) from the environment, never typed: it must name exactly
    what is installed where the tests run."""
    path = ROOT / "scripts" / "tested_versions.py"
    spec = importlib.util.spec_from_file_location("tested_versions", path)
    versions = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(versions)
    assert "tested_versions.py --write" in (ROOT / "scripts" / "setup.sh").read_text()
    page = (DOCS / "install.md").read_text()
    assert versions.written(page) == versions.table(), (
        "the environment differs from docs/install.md: run "
        "`.venv/bin/python scripts/tested_versions.py --write`"
    )
    assert "| transformers |" in versions.table() and "5.24.0" not in page


def test_every_recipe_file_is_in_the_recipes_table():
    """A recipe added to ``recipes/`` without a row in docs/recipes.md is one a user never
    finds (two structured ones were)."""
    page = (DOCS / "recipes.md").read_text()
    table = page[page.index("## The recipes in `recipes/`") :]
    listed = set(re.findall(r"^\| `(recipes/[\w.-]+\.yaml)` \|", table, flags=re.M))
    files = {f"recipes/{path.name}" for path in (ROOT / "recipes").glob("*.yaml")}
    missing = sorted(files - listed)
    assert not missing, f"recipes missing from docs/recipes.md: {missing}"
