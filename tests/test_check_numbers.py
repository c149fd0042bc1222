"""``scripts/check_numbers.py`` on a tiny docs + results tree: a number is looked up in the
results file its sentence, paragraph, section or page cites (not in every file), integers with
units are checked, and a ratio must be printed, recomputed or marked as a goal."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def check_numbers():
    path = ROOT / "scripts" / "check_numbers.py"
    spec = importlib.util.spec_from_file_location("check_numbers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def results(tmp_path):
    folder = tmp_path / "results"
    (folder / "nested").mkdir(parents=True)
    (folder / "lowrank.md").write_text(
        "| method | wiki-test | lee | s | peak MiB |\n| gfwsvd | 23.65 | 39.59 | 8230 | 6332 |\n"
        "| dense | 19.38 | 30.53 | 12 | 900 |\nfactors 1.0002 x\n"
    )
    (folder / "runtime.md").write_text("| sparsegpt 2:4 | 67.10 | 135.32 | 539 s |\n")
    (folder / "nested" / "speed.md").write_text("| packed | 1.07× |\n")
    (folder / "nested" / "speed.json").write_text('{"speedup": 1.08}')  # a value, not a ratio
    return folder


def _untraced(check_numbers, results, tmp_path, text: str) -> list[str]:
    page = tmp_path / "page.md"
    page.write_text(text)
    missing = check_numbers.check([page], check_numbers.Sources(results))
    return [line.split(": ", 1)[1] for line in missing]


def test_a_number_from_another_results_file_is_flagged(check_numbers, results, tmp_path):
    text = (
        "From `benchmarks/results/lowrank.md`: 23.65 / 39.59, against SparseGPT's 67.10.\n\n"
        "SparseGPT 2:4 scores 67.10 ([runtime](../benchmarks/results/runtime.md)).\n"
    )
    assert _untraced(check_numbers, results, tmp_path, text) == ["67.10 (looked in lowrank.md)"]


def test_the_sentence_then_the_section_then_the_page_decides(check_numbers, results, tmp_path):
    text = (
        "# Low rank\n\nResults in benchmarks/results/lowrank.md.\n\n## Table\n\n"
        "| row | 23.65 |\n\n## Pruning\n\nSparseGPT: see benchmarks/results/runtime.md.\n\n"
        "- it scores 67.10\n- and 23.65 here.\n\n## Uncited\n\nThe page's files: 67.10, 23.65.\n"
    )
    found = _untraced(check_numbers, results, tmp_path, text)
    assert found == ["23.65 (looked in runtime.md)"]  # its item cites nothing: the section's


def test_integers_with_units_are_checked(check_numbers, results, tmp_path):
    text = (
        "Per benchmarks/results/lowrank.md: 8230 s and 6332 MiB; 8231 s and 6333 MiB are not. "
        "539 s is runtime.md's. 4 windows and 2 cores are settings, 128 tokens too.\n"
    )
    assert _untraced(check_numbers, results, tmp_path, text) == [
        "8231 (looked in lowrank.md)",
        "6333 (looked in lowrank.md)",
        "539 (looked in lowrank.md)",
    ]


def test_a_ratio_is_printed_recomputed_or_marked(check_numbers, results, tmp_path):
    text = (
        "In benchmarks/results/lowrank.md, the factors take 1.0002 × their layers (printed).\n\n"
        "23.65 against 19.38 is 1.220 × dense (recomputed from its sentence).\n\n"
        "Within 1.221 × dense is wrong: 23.65 / 19.38 rounds otherwise.\n\n"
        "It lands within 1.3 × dense. <!-- goal -->\n\n"
        "The job's wiki-test is 1.2 × dense. <!-- derived: 23.65 / 19.38 -->\n\n"
        "The job's lee is 1.4 × dense. <!-- derived: 39.59 / 30.53 -->\n\n"
        "Within 1.3 × dense, again, unmarked.\n"
    )
    assert _untraced(check_numbers, results, tmp_path, text) == [
        "ratio 1.221 (looked in lowrank.md)",
        "ratio 1.4 (looked in lowrank.md)",
        "ratio 1.3 (looked in lowrank.md)",
    ]


def test_a_cited_folder_means_its_files_and_code_is_skipped(check_numbers, results, tmp_path):
    text = (
        "Compiled (benchmarks/results/nested/): 1.07× faster, 1.08× slower.\n\n"
        "`--lr 54.29` and\n```\nppl 54.29\n```\nPython 3.10, torch 2.13.0.\n"
    )
    assert _untraced(check_numbers, results, tmp_path, text) == [
        "ratio 1.08 (looked in nested/speed.json, nested/speed.md)"
    ]


def test_a_page_citing_nothing_is_checked_against_every_file(check_numbers, results, tmp_path):
    text = "SparseGPT 67.10 and GFWSVD 23.65; 54.29 from nowhere, 6,332 MiB at peak.\n"
    assert _untraced(check_numbers, results, tmp_path, text) == [
        "54.29 (looked in any results file)"
    ]
