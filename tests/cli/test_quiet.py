"""``-q``: warnings only, no progress bars, in a real process (tqdm reads TQDM_DISABLE once, at
import, and a bar given ``disable=False`` ignores it: ``lmcompress.compressor.util.progress``
handles both)."""

import subprocess
import sys

import matplotlib
import pytest

from lmcompress.compressor.util.progress import bar_disabled
from lmcompress.methods import METHODS


def test_bar_disabled_follows_the_caller_and_the_environment(monkeypatch):
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    assert bar_disabled(True) is False and bar_disabled(False) is True
    monkeypatch.setenv("TQDM_DISABLE", "1")
    assert bar_disabled(True) is True
    monkeypatch.setenv("TQDM_DISABLE", "0")
    assert bar_disabled(True) is False


METHOD_FLAGS = {  # every method: its bars (per layer, per block, per step) all silenced
    "magnitude": [],
    "wanda": [],
    "sparsegpt": [],
    "maskllm": ["--steps", "1"],
    "subnet": ["--steps", "1"],
    "structured": ["--structure", "channels", "layers", "--distill-steps", "1"],
    "svd": [],
    "asvd": [],
    "svd-llm": [],
    "fwsvd": [],
    "gfwsvd": [],
    "int8": [],
    "rtn": ["--group-size", "16"],
    "gptq": ["--group-size", "16"],
}


def test_every_method_is_in_the_quiet_test():
    assert sorted(METHOD_FLAGS) == sorted(METHODS)


@pytest.mark.parametrize("method", list(METHOD_FLAGS))
def test_quiet_job_prints_nothing_on_stderr(method, tiny_checkpoint, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"Document {i}. The quick brown fox." for i in range(40)))
    argv = [str(tiny_checkpoint), "--method", method, *METHOD_FLAGS[method]]
    argv += ["--calib", str(corpus), "--nsamples", "4"]
    argv += [
        "--eval",
        str(corpus),
        "--seq-len",
        "32",
        "--eval-tokens",
        "0",
        "-o",
        str(tmp_path / "out"),
    ]
    done = subprocess.run(
        [sys.executable, "-m", "lmcompress.cli.main", *argv, "-q"],
        capture_output=True,
        text=True,
        check=False,
        env={
            "PATH": "/usr/bin:/bin",
            "HOME": str(tmp_path),
            "OMP_NUM_THREADS": "1",
            # report.png: matplotlib's font cache from this user's (in an empty HOME, building
            # it takes seconds and, past 5 s, warns on stderr)
            "MPLCONFIGDIR": matplotlib.get_cachedir(),
        },
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == "", done.stderr  # no bars (blocks, perplexity, saving), no INFO logs
    assert "compressed ppl" in done.stdout
