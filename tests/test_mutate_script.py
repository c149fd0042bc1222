"""scripts/mutate.py: one line replaced (indentation kept), the file restored whatever the
tests did, caught and survived told apart; the committed table is well formed."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("mutate", ROOT / "scripts" / "mutate.py")
mutate = importlib.util.module_from_spec(_spec)
sys.modules["mutate"] = mutate  # dataclasses look their module up
_spec.loader.exec_module(mutate)


def test_mutated_text_replaces_one_line_keeping_its_indentation():
    text = "def f(x):\n    if x > 0:\n        return x\n    return -x\n"
    new, line = mutate.mutated_text(text, "if x > 0:", "if x >= 0:")
    assert line == 2
    assert new == "def f(x):\n    if x >= 0:\n        return x\n    return -x\n"
    with pytest.raises(ValueError, match="occurs 0 times"):
        mutate.mutated_text(text, "if x < 0:", "pass")
    with pytest.raises(ValueError, match="occurs 2 times"):
        mutate.mutated_text(text + "    return -x\n", "return -x", "return x")


def test_check_restores_the_file_and_tells_caught_from_survived(tmp_path):
    tree = tmp_path / "tree"
    tree.mkdir()
    source = "def sign(x):\n    if x < 0:\n        return -1\n    return 1\n"
    (tree / "mod.py").write_text(source)
    test = "from mod import sign\n\n\ndef test_sign():\n    assert sign(-3) == -1\n"
    (tree / "test_mod.py").write_text(test)
    caught = mutate.Mutation("flip", "mod.py", "if x < 0:", "if x > 0:", ["test_mod.py"])
    survived = mutate.Mutation(
        "zero", "mod.py", "if x < 0:", "if x <= 0:", ["test_mod.py"], verdict="untested: 0"
    )
    first, second = (mutate.check(tree, m, timeout=120) for m in (caught, survived))
    assert (first.caught, first.line, first.verdict) == (True, 2, "caught")
    assert "assert 1 == -1" in first.failure
    assert (second.caught, second.verdict, second.failure) == (False, "untested: 0", None)
    assert (tree / "mod.py").read_text() == source


def test_committed_table_names_existing_files_and_tests():
    mutations = mutate.load_table(mutate.TABLE)
    assert len(mutations) >= 16
    for m in mutations:
        assert (ROOT / m.file).is_file(), m.id
        assert m.tests and all((ROOT / t).exists() for t in m.tests), m.id
        assert m.original.strip() != m.replacement.strip(), m.id
        if m.killed_by:  # names a test that exists
            path, _, name = m.killed_by.partition("::")
            assert f"def {name}(" in (ROOT / path).read_text(), m.id
