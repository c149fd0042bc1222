"""One owner of an output path for the whole job, in real processes (issue 39, item 1): a job
inside or around a running one is refused, and a file written into the output while a job runs
is never deleted by its save.

A job made to wait: the child process registers an evaluate hook that says "scoring" and
waits for a line on stdin, so the parent acts while the job is between its checks and its save.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import lmcompress.jobs.run as pipeline
from lmcompress.cli.main import main
from lmcompress.compressor.util.locks import lock_path

TEXT = "\n\n".join(f"Document {i}. The quick brown fox jumps over the lazy dog." for i in range(60))

# compress-model in a process whose every evaluate step waits for a line on stdin
WAITING_JOB = """
import sys
from lmcompress.cli.main import main
from lmcompress.jobs.evaluate import register_evaluate_hook

def wait(model):
    print("scoring", flush=True)
    sys.stdin.readline()

register_evaluate_hook(wait)
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    return path


def _job(checkpoint, corpus, out, *extra: str) -> list[str]:
    common = ["--eval", str(corpus), "--calib", str(corpus), "--seq-len", "32"]
    return [str(checkpoint), *common, "--eval-tokens", "256", "-o", str(out), *extra]


def _waiting(argv: list[str]) -> subprocess.Popen:
    """Start the job; return once it waits at its first evaluate step (past every check)."""
    job = subprocess.Popen(
        [sys.executable, "-c", WAITING_JOB, *argv],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = job.stdout.readline().strip()
    assert line == "scoring", (line, job.poll(), job.stderr.read() if job.poll() else "")
    return job


def _finish(job: subprocess.Popen) -> tuple[int, str]:
    job.stdin.close()  # every further readline returns at once
    job.stdin = None
    _, err = job.communicate(timeout=120)
    return job.returncode, err


def test_a_file_written_into_the_output_during_the_job_is_kept(tmp_path, tiny_checkpoint, corpus):
    out = tmp_path / "out"
    job = _waiting(_job(tiny_checkpoint, corpus, out, "-q"))
    try:
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    finally:
        code, err = _finish(job)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err[-3000:]
    assert "changed while the job ran (1 new item(s) such as notes.txt)" in lines[0], lines[0]
    assert (out / "notes.txt").read_text() == "mine" and len(list(out.iterdir())) == 1
    (kept,) = tmp_path.glob("out.new-*")
    assert str(kept) in lines[0] and (kept / "config.json").is_file()


def test_nested_outputs_of_running_jobs_are_refused(tmp_path, tiny_checkpoint, corpus, capfd):
    """``-o a/b`` runs in another process: ``-o a --overwrite`` and ``-o a/b/c`` are refused in
    one line (``main`` in this process, stderr at the descriptor); the lock of ``a/b`` survives
    both, so a third ``-o a/b`` is refused too; the first finishes."""
    inner = tmp_path / "a" / "b"
    job = _waiting(_job(tiny_checkpoint, corpus, inner, "-q"))
    try:
        assert lock_path(inner).exists()
        refusals = [
            (tmp_path / "a", "contains the output of another running job"),
            (inner / "c", f"is inside {inner}, which another run is writing"),
            (inner, "is being written by another run"),
        ]
        for out, says in refusals:
            capfd.readouterr()
            code = main(_job(tiny_checkpoint, corpus, out, "--overwrite"))
            err = capfd.readouterr().err
            lines = err.strip().splitlines()
            assert code == 2 and len(lines) == 1, err[-3000:]
            assert says in lines[0] and f"pid {job.pid} on" in lines[0], lines[0]
    finally:
        code, err = _finish(job)
    assert code == 0, err[-3000:]
    assert (inner / "config.json").is_file() and not lock_path(inner).exists()


# --- the inputs, whatever option names them -----------------------------------------------------


def _no_loading(*_args, **_kwargs):
    raise AssertionError("the model was loaded before the error")


@pytest.mark.parametrize("flag", ["--eval", "--calib", "--config", "--prior-from"])
def test_an_input_inside_the_output_is_refused_even_with_overwrite(
    tmp_path, tiny_checkpoint, monkeypatch, capsys, flag
):
    """Each input lies in ``-o``, which ``--overwrite`` would replace: one line, exit 2,
    before the model loads, and the input is still there."""
    monkeypatch.setattr(pipeline, "load_model", _no_loading)
    out = tmp_path / "out"
    out.mkdir()
    (out / "corpus.txt").write_text(TEXT)
    (out / "recipe.yaml").write_text("method: maskllm\n")
    (out / "prior").mkdir()
    given = {"--config": out / "recipe.yaml", "--prior-from": out / "prior"}
    argv = [str(tiny_checkpoint), "--method", "maskllm", "--seq-len", "32", "--nsamples", "4"]
    (tmp_path / "corpus.txt").write_text(TEXT)
    for corpus in sorted({"--eval", "--calib"} - {flag}):
        argv += [corpus, str(tmp_path / "corpus.txt")]
    argv += [flag, str(given.get(flag, out / "corpus.txt")), "-o", str(out), "--overwrite"]
    if flag == "--config":
        argv.remove("--method"), argv.remove("maskllm")
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err, err
    assert f"output {out} contains the input" in err and "even with --overwrite" in err, err
    assert sorted(p.name for p in out.iterdir()) == ["corpus.txt", "prior", "recipe.yaml"]


def test_an_output_path_that_is_not_utf8_is_refused_before_any_work(
    tmp_path, tiny_checkpoint, monkeypatch, capsys
):
    """Undecodable bytes in argv (``-o $'out\\xff'``) arrive as surrogates: refused with the
    bytes shown, before the model loads, instead of failing at the save."""
    monkeypatch.setattr(pipeline, "load_model", _no_loading)
    out = os.fsdecode(os.fsencode(tmp_path) + b"/out\xff")
    capsys.readouterr()
    assert main([str(tiny_checkpoint), "-o", out, "--skip-dense"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(
        "out\\xff is not valid UTF-8: the export records its path in text files; "
        "choose a UTF-8 name"
    ), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-llama"]
