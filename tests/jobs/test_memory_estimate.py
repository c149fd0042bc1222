"""The memory check against reality: the estimate a job is admitted with lies within the stated
factor (``ESTIMATE_FACTOR``) of the peak RSS the job reaches, for every registered method, each
on a tiny family; and a job the check refuses runs with ``--force``.

The peaks are measured on real ``compress-model`` jobs, each in a fresh process
(``benchmarks.runner``: the ``ru_maxrss`` of that process; the pytest process's own RSS says
nothing about a job's), two at a time. On the tiny models the estimate is mostly the libraries'
fixed share (``RUNTIME_BYTES``); ``benchmarks/results/memory_estimate.md`` has SmolLM2-135M,
where the method's own parts dominate.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import FAMILY_NAMES, make_tiny_model, make_tiny_tokenizer

import lmcompress.compressor.model.budget as budget
from benchmarks.runner import CLI, Job, run_job
from lmcompress.cli.main import main
from lmcompress.compressor.io.layout import MANIFEST
from lmcompress.compressor.model.budget import ESTIMATE_FACTOR, GiB
from lmcompress.methods import METHODS

TEXT = "\n\n".join(f"Document {i}: the quick brown fox jumps over the lazy dog." for i in range(40))
SHORT = {  # 100 steps by default; group 128 does not divide the tiny widths
    "maskllm": ["--steps", "2"],
    "subnet": ["--steps", "2"],
    "rtn": ["--group-size", "32"],
    "gptq": ["--group-size", "32"],
}
# every method, each on a family in turn: all seven families are covered too
PAIRS = [(method, FAMILY_NAMES[i % len(FAMILY_NAMES)]) for i, method in enumerate(METHODS)]


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """``{method: (estimate bytes, peak RSS bytes, exit code)}`` of one job per method."""
    root = tmp_path_factory.mktemp("memory")
    corpus = root / "corpus.txt"
    corpus.write_text(TEXT)
    jobs = []
    for method, family in PAIRS:
        checkpoint = root / family
        if not checkpoint.exists():
            make_tiny_model(family).save_pretrained(checkpoint)
            make_tiny_tokenizer().save_pretrained(checkpoint)
        out = root / "out" / method
        argv = [checkpoint, "--method", method, "--calib", corpus, "--eval", corpus]
        argv += ["--seq-len", "32", "--nsamples", "8", "-o", out, "-q", *SHORT.get(method, [])]
        jobs.append(Job(method, (*CLI, *argv), out / MANIFEST, check=False))
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda job: run_job(job, root / "logs"), jobs))
    found = {}
    for run in runs:
        estimate = run.result["results"]["memory_estimate"]["total"] if run.result else None
        found[run.name] = (estimate, run.peak_rss_mb * 2**20, run.returncode, run.stderr)
    return found


@pytest.mark.memory
@pytest.mark.parametrize(("method", "family"), PAIRS)
def test_estimate_is_within_the_stated_factor_of_the_measured_peak(measured, method, family):
    estimate, peak, code, log = measured[method]
    assert code == 0, f"{method} on {family}: exit {code}, see {log}"
    ratio = estimate / peak
    assert 1 / ESTIMATE_FACTOR <= ratio <= ESTIMATE_FACTOR, (
        f"{method} on {family}: estimate {estimate / 2**20:.0f} MiB, "
        f"peak RSS {peak / 2**20:.0f} MiB (estimate / peak {ratio:.2f})"
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
