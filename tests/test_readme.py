"""The README is the front page: short, its numbers traced to results files, its paths real, and
its test command the one CI runs."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def _check_numbers():
    path = ROOT / "scripts" / "check_numbers.py"
    spec = importlib.util.spec_from_file_location("check_numbers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_is_a_front_page():
    assert len(README.read_text().splitlines()) <= 250


def test_every_number_in_the_readme_is_in_a_results_file():
    assert _check_numbers().check([README]) == []


def test_the_number_check_catches_an_untraced_number_and_skips_code(tmp_path):
    check_numbers = _check_numbers()
    page = tmp_path / "page.md"
    page.write_text(
        "SparseGPT 2:4 scores 66.46 here and 54.29 there, 6,261 MiB at peak.\n"
        "`--lr 54.29` and\n```\nppl 54.29\n```\nPython 3.10, torch 2.13.0.\n"
    )
    missing = check_numbers.check([page])
    assert [line.split(": ", 1)[1].split(" (")[0] for line in missing] == ["54.29", "6,261"]
    assert ":1: 54.29 (looked in any results file)" in missing[0]


def test_the_readme_test_command_is_what_ci_runs():
    ci = (ROOT / ".ci/run").read_text().strip().splitlines()[-1]
    blocks = re.findall(r"```bash\n(.*?)\n```", README.read_text(), re.S)
    assert ci in blocks


def test_every_path_the_readme_names_exists():
    text = README.read_text()
    linked = re.findall(r"\]\(([^)#\s]+)\)", text)
    quoted = re.findall(r"`([\w.-]+(?:/[\w.-]+)+\.(?:md|yaml|py|sh|json|png))`", text)
    missing = [p for p in {*linked, *quoted} if not (ROOT / p).exists()]
    assert missing == []
    assert len(linked) > 10 and len(quoted) > 5
