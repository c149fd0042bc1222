"""``-q``: warnings only, no progress bars, in a real process (tqdm reads TQDM_DISABLE once, at
import, and a bar given ``disable=False`` ignores it: ``lmcompress.compressor.util.progress``
handles both)."""

import pytest
from method_jobs import METHOD_FLAGS

from lmcompress.compressor.util.progress import bar_disabled
from lmcompress.methods import METHODS


def test_bar_disabled_follows_the_caller_and_the_environment(monkeypatch):
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    assert bar_disabled(True) is False and bar_disabled(False) is True
    monkeypatch.setenv("TQDM_DISABLE", "1")
    assert bar_disabled(True) is True
    monkeypatch.setenv("TQDM_DISABLE", "0")
    assert bar_disabled(True) is False


def test_every_method_runs_a_quiet_job():
    assert sorted(METHOD_FLAGS) == sorted(METHODS)


@pytest.mark.parametrize("method", list(METHOD_FLAGS))
def test_quiet_job_prints_nothing_on_stderr(method, method_jobs):
    """Each method's job with ``-q`` (``tests/method_jobs.py``: a fresh process, an empty HOME
    where the first job builds the CPU kernels, no TQDM_DISABLE): no bars (blocks, steps,
    perplexity, saving), no INFO logs, the perplexity still on stdout."""
    done = method_jobs[method]
    assert done.returncode == 0, done.stderr
    assert done.stderr == "", done.stderr
    assert "compressed ppl" in done.stdout
