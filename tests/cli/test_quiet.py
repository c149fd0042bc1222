"""``-q``: warnings only, no progress bars, in a real process (tqdm reads TQDM_DISABLE once, at
import, and a bar given ``disable=False`` ignores it: ``lmcompress.compressor.util.progress``
handles both)."""

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import matplotlib
import pytest
from conftest import make_tiny_model, make_tiny_tokenizer

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


@pytest.fixture(scope="module")
def quiet_runs(tmp_path_factory):
    """``{method: CompletedProcess}`` of one ``-q`` job per method, two at a time (one thread
    each), all in one empty HOME: the first job that needs the CPU kernels builds them there (a
    build that must be silent too), the others load that build."""
    root = tmp_path_factory.mktemp("quiet")
    checkpoint, home = root / "tiny-llama", root / "home"
    make_tiny_model("llama").save_pretrained(checkpoint)
    make_tiny_tokenizer().save_pretrained(checkpoint)
    home.mkdir()
    corpus = root / "corpus.txt"
    corpus.write_text("\n\n".join(f"Document {i}. The quick brown fox." for i in range(40)))
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(home),
        "OMP_NUM_THREADS": "1",
        # report.png: matplotlib's font cache from this user's (in an empty HOME, building it
        # takes seconds and, past 5 s, warns on stderr)
        "MPLCONFIGDIR": matplotlib.get_cachedir(),
    }

    def run(method: str) -> subprocess.CompletedProcess:
        argv = [str(checkpoint), "--method", method, *METHOD_FLAGS[method]]
        argv += ["--calib", str(corpus), "--nsamples", "4", "--eval", str(corpus)]
        argv += ["--seq-len", "32", "--eval-tokens", "0", "-o", str(root / "out" / method)]
        command = [sys.executable, "-m", "lmcompress.cli.main", *argv, "-q"]
        return subprocess.run(command, capture_output=True, text=True, check=False, env=env)

    with ThreadPoolExecutor(2) as pool:
        return dict(zip(METHOD_FLAGS, pool.map(run, METHOD_FLAGS), strict=True))


@pytest.mark.parametrize("method", list(METHOD_FLAGS))
def test_quiet_job_prints_nothing_on_stderr(method, quiet_runs):
    done = quiet_runs[method]
    assert done.returncode == 0, done.stderr
    assert done.stderr == "", done.stderr  # no bars (blocks, perplexity, saving), no INFO logs
    assert "compressed ppl" in done.stdout
