"""``optimum-cli lmcompress``: found by optimum-cli through the installed namespace module, the
same options as ``compress-model``, the same one-line errors."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("optimum.commands.optimum_cli")

from lmcompress.compressor.io.layout import (  # noqa: E402
    MANIFEST,  # noqa: E402
    MODEL_CARD,
    REPORT_PNG,
)

OPTIMUM_CLI = shutil.which("optimum-cli", path=str(Path(sys.executable).parent))
REGISTER = Path(__file__).parents[2] / "optimum" / "commands" / "register"


def _env(tmp_path):
    import matplotlib

    # matplotlib's font cache from this user's: in an empty HOME, building it takes seconds
    # and, past 5 s, warns on stderr
    return {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "OMP_NUM_THREADS": "1",
        "MPLCONFIGDIR": matplotlib.get_cachedir(),
    }


def test_register_module_is_a_light_namespace_module():
    # PEP 420 namespace: an __init__.py anywhere on the way would hide optimum's own modules
    for folder in (REGISTER, REGISTER.parent, REGISTER.parent.parent):
        assert not (folder / "__init__.py").exists(), folder
    # optimum-cli imports it on every start: it must not pull in lmcompress (and torch)
    code = (
        "import sys, importlib; m = importlib.import_module('optimum.commands.register.lmcompress')"
        "; print(len(m.REGISTER_COMMANDS), 'torch' in sys.modules, 'lmcompress' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/"
    )
    assert done.stdout.split() == ["1", "False", "False"]


@pytest.mark.skipif(OPTIMUM_CLI is None, reason="optimum-cli not installed beside this python")
def test_optimum_cli_help_lists_the_command(tmp_path):
    done = subprocess.run(
        [OPTIMUM_CLI, "--help"], capture_output=True, text=True, env=_env(tmp_path), cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert "lmcompress" in done.stdout and "compress-model" in done.stdout


@pytest.mark.skipif(OPTIMUM_CLI is None, reason="optimum-cli not installed beside this python")
def test_tiny_job_through_optimum_cli(tiny_checkpoint, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"Document {i}. The quick brown fox jumps." for i in range(40)))
    out = tmp_path / "out"
    argv = [OPTIMUM_CLI, "lmcompress", str(tiny_checkpoint), "--method", "sparsegpt"]
    argv += ["--sparsity", "2:4", "--calib", str(corpus), "--nsamples", "4", "--eval", str(corpus)]
    argv += ["--seq-len", "32", "--eval-tokens", "0", "-o", str(out), "-q"]
    # cwd elsewhere: optimum-cli must find the command through the installed package
    done = subprocess.run(argv, capture_output=True, text=True, env=_env(tmp_path), cwd=tmp_path)

    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # -q: no bars, no logs, even with transformers imported first
    assert "compressed ppl" in done.stdout
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["method"] == "sparsegpt" and manifest["config"]["sparsity"] == "2:4"
    assert (out / MODEL_CARD).is_file()
    assert (out / REPORT_PNG).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _optimum_main(monkeypatch, *args):
    from optimum.commands import optimum_cli

    monkeypatch.setattr(sys, "argv", ["optimum-cli", "lmcompress", *args])
    with pytest.raises(SystemExit) as info:
        optimum_cli.main()
    return info.value.code


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--config", "no-such-recipe.yaml"], "recipe no-such-recipe.yaml not found"),
        (["--method", "sparsegpt", "--sparsity", "3:2"], "sparsity"),
        (["--method", "svd", "--ratio", "1.5"], "ratio"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(monkeypatch, capsys, tmp_path, args, message):
    import lmcompress.jobs.run as pipeline

    def never(*_args, **_kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(pipeline, "load_model", never)
    monkeypatch.chdir(tmp_path)
    code = _optimum_main(monkeypatch, *args, "-o", str(tmp_path / "out"))
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("optimum-cli lmcompress: error: ") and message in err
    assert err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_help_shows_the_methods_options(monkeypatch, capsys):
    assert _optimum_main(monkeypatch, "--method", "svd", "--help") == 0
    shown = capsys.readouterr().out
    assert "usage: optimum-cli lmcompress" in shown
    assert "--ratio" in shown and "--nsamples" in shown and "svd options" in shown
