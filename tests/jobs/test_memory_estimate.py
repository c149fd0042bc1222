"""The memory check against reality: the estimate a job is admitted with lies within the stated
factor (``ESTIMATE_FACTOR``) of the peak RSS the job reaches, for every registered method, each
on a tiny family; and a job the check refuses runs with ``--force``.

The peaks are measured on real ``compress-model`` jobs, each in a fresh process
(``tests/method_jobs.py``, shared with the quiet test: the ``ru_maxrss`` of that process; the
pytest process's own RSS says nothing about a job's), two at a time. On the tiny models the
estimate is mostly the libraries' fixed share (``RUNTIME_BYTES``);
``benchmarks/results/memory_estimate.md`` has SmolLM2-135M, where the method's own parts
dominate.
"""

from __future__ import annotations

import json

import pytest
from method_jobs import PAIRS

import lmcompress.compressor.model.budget as budget
from lmcompress.cli.main import main
from lmcompress.compressor.io.layout import MANIFEST
from lmcompress.compressor.model.budget import ESTIMATE_FACTOR, GiB

TEXT = "\n\n".join(f"Document {i}: the quick brown fox jumps over the lazy dog." for i in range(40))


@pytest.mark.memory
@pytest.mark.parametrize(("method", "family"), PAIRS)
def test_estimate_is_within_the_stated_factor_of_the_measured_peak(method_jobs, method, family):
    done = method_jobs[method]
    assert done.family == family
    assert done.returncode == 0, f"{method} on {family}: exit {done.returncode}: {done.stderr}"
    estimate = done.record["results"]["memory_estimate"]["total"]
    ratio = estimate / done.peak_rss_bytes
    assert 1 / ESTIMATE_FACTOR <= ratio <= ESTIMATE_FACTOR, (
        f"{method} on {family}: estimate {estimate / 2**20:.0f} MiB, "
        f"peak RSS {done.peak_rss_bytes / 2**20:.0f} MiB (estimate / peak {ratio:.2f})"
    )


def test_a_refused_job_runs_with_force(tiny_checkpoint, tmp_path, monkeypatch, capsys, caplog):
    """Refused in one line with exit 2 and nothing written; with ``--force`` it runs, warned."""
    monkeypatch.setattr(budget, "available_bytes", lambda _device: (GiB // 10, "the test's fake"))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    out = tmp_path / "out"
    argv = [str(tiny_checkpoint), "--method", "wanda", "--calib", str(corpus), "--eval"]
    argv += ["--seq-len", "32", "--nsamples", "4", "-o", str(out), "-q"]

    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("compress-model: error: the job needs about")
    assert "but only 0.1 GiB is available (the test's fake)" in err and "--force" in err
    assert not out.exists()

    assert main([*argv, "--force"]) == 0
    assert json.loads((out / MANIFEST).read_text())["method"] == "wanda"
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("going on (--force)" in message for message in warned), warned
