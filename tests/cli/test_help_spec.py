"""``--help`` answered from ``lmcompress/cli/parsers.json`` (:mod:`lmcompress.cli.help_spec`):
the file describes the real parsers exactly, the parsers it rebuilds print the same help, every
option has a help text, and ``--help`` imports neither torch nor transformers."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from lmcompress.cli.bench import bench_parser
from lmcompress.cli.compress import add_job_arguments
from lmcompress.cli.evaluate import eval_parser
from lmcompress.cli.help_spec import SPEC, build_parser, specs
from lmcompress.cli.listing import methods_parser
from lmcompress.cli.main import COMMANDS, main
from lmcompress.cli.optimum import PROG as OPTIMUM_PROG
from lmcompress.cli.optimum import add_arguments
from lmcompress.cli.parsers import described_parsers, job_parser
from lmcompress.methods import METHODS

ROOT = Path(__file__).resolve().parents[2]
REAL = {"methods": methods_parser, "eval": eval_parser, "bench": bench_parser}
REAL |= {f"job:{name}": (lambda name=name: job_parser(name)) for name in METHODS}


def _spec(key: str) -> dict:
    kind, _, method = key.partition(":")
    return specs()["job"][method] if method else specs()[kind]


def test_the_file_describes_the_parsers_as_they_are():
    written = json.loads(SPEC.read_text())
    assert written == json.loads(json.dumps(described_parsers())), (
        "a flag or help text changed: run `PYTHONPATH=. python scripts/write_help_spec.py`"
    )
    assert set(written) == {*COMMANDS, "job"} and set(written["job"]) == set(METHODS)


@pytest.mark.parametrize("key", sorted(REAL))
def test_the_rebuilt_parser_prints_the_real_help(key, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    assert build_parser(_spec(key)).format_help() == REAL[key]().format_help()


@pytest.mark.parametrize("key", sorted(REAL))
def test_every_option_has_a_help_text(key):
    parser = REAL[key]()
    missing = [
        action.option_strings or action.dest
        for action in parser._actions  # argparse's own list of every action
        if not (action.help and action.help.strip()) or action.help == argparse.SUPPRESS
    ]
    assert not missing, f"{key}: options without help: {missing}"


def test_the_help_check_sees_an_option_without_help():
    parser = bench_parser()
    parser.add_argument("--bare")
    assert [a.dest for a in parser._actions if not a.help] == ["bare"]


@pytest.mark.parametrize(
    "argv", [[], ["eval"], ["bench"], ["methods"], ["--method", "maskllm"], ["--method", "int8"]]
)
def test_help_imports_no_torch(argv):
    """What makes ``--help`` take 5-11 s is importing torch and transformers: asserted directly
    (a wall-clock bound would be flaky on a shared machine)."""
    code = (
        "import sys\n"
        "from lmcompress.cli.main import main\n"
        f"try:\n    main({[*argv, '--help']!r})\nexcept SystemExit as exit:\n"
        "    assert exit.code == 0, exit.code\n"
        "heavy = sorted({'torch', 'transformers', 'accelerate'} & set(sys.modules))\n"
        "assert not heavy, heavy\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage: compress-model" in done.stdout


def test_help_with_a_recipe_or_unknown_method_asks_the_real_parser(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("method: sparsegpt\n")
    with pytest.raises(SystemExit):
        main(["--config", str(recipe), "--help"])
    assert "sparsegpt options" in capsys.readouterr().out
    assert main(["--method", "nope", "--help"]) == 2
    assert "unknown method 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize("method", ["magnitude", "gfwsvd"])
def test_optimum_help_from_the_file_is_the_real_one(method, monkeypatch):
    """``optimum-cli lmcompress --help`` adds the described actions to optimum's own parser."""
    monkeypatch.setenv("COLUMNS", "100")
    real = argparse.ArgumentParser(prog=OPTIMUM_PROG)
    add_job_arguments(real, ["--method", method], prog=OPTIMUM_PROG)
    from_file = argparse.ArgumentParser(prog=OPTIMUM_PROG)
    add_arguments(from_file, ["--method", method, "--help"])
    assert from_file.format_help() == real.format_help()
    assert f"`{OPTIMUM_PROG} --method NAME --help`" in from_file.format_help().replace("\n", " ")


def test_optimum_help_imports_no_torch():
    code = (
        "import argparse, sys\n"
        "from lmcompress.cli.optimum import add_arguments\n"
        "parser = argparse.ArgumentParser(prog='optimum-cli lmcompress')\n"
        "add_arguments(parser, ['--method', 'maskllm', '--help'])\n"
        "try:\n    parser.parse_args(['--method', 'maskllm', '--help'])\n"
        "except SystemExit as exit:\n    assert exit.code == 0, exit.code\n"
        "heavy = sorted({'torch', 'transformers', 'accelerate'} & set(sys.modules))\n"
        "assert not heavy, heavy\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "maskllm options" in done.stdout
