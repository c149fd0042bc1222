"""A real ``compress-model`` job killed while it saves: SIGKILL leaves a temporary sibling that
the next run removes; SIGTERM cleans up at once and exits 143. Exported files are readable by
others (safetensors writes them 0600)."""

import os
import signal
import stat
import subprocess
import sys
import time

import pytest

from lmcompress.cli.main import main
from lmcompress.compressor.util.locks import lock_path

TEXT = "\n\n".join(
    f"Document {i}. The quick brown fox jumps over the lazy dog {i} times, then rests."
    for i in range(60)
)

# Runs the job with the save stopped half-way: the weights are written, then it waits.
SCRIPT = """
import pathlib, sys, time
import lmcompress.compressor.io.save as export
from lmcompress.cli.main import main

def stalled(self, *args, **kwargs):  # the weights are written; the manifest is next
    pathlib.Path(sys.argv[1]).touch()
    time.sleep(120)

export.Export.finish = stalled
sys.exit(main(sys.argv[2:]))
"""


@pytest.fixture
def job(tiny_checkpoint, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    out = tmp_path / "job" / "out"  # alone in its parent: every leftover shows
    argv = [str(tiny_checkpoint), "--eval", str(corpus), "--calib", str(corpus)]
    argv += ["--seq-len", "32", "--eval-tokens", "0", "-o", str(out), "-q"]
    return argv, out


def _stalled_in_save(argv, ready):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(ready), *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not ready.exists():
        if child.poll() is not None or time.monotonic() > deadline:
            child.kill()
            pytest.fail(f"job never reached the save: {child.communicate()[1][-2000:]}")
        time.sleep(0.05)
    return child


def test_sigkill_leaves_a_temporary_that_the_next_run_removes(job, tmp_path):
    argv, out = job
    child = _stalled_in_save(argv, tmp_path / "ready")
    child.kill()
    child.communicate()
    (left,) = out.parent.iterdir()  # the lock is kept elsewhere (its flock died with the job)
    assert left.name.startswith(".out.tmp-") and (left / "model.safetensors").exists()
    assert lock_path(out).exists()

    assert main(argv) == 0
    assert [p.name for p in out.parent.iterdir()] == ["out"]
    assert (out / "model.safetensors").exists()


def test_sigterm_cleans_up_and_exits_143(job, tmp_path):
    argv, out = job
    child = _stalled_in_save(argv, tmp_path / "ready")
    child.send_signal(signal.SIGTERM)
    _, stderr = child.communicate(timeout=30)
    assert child.returncode == 143
    assert "compress-model: terminated" in stderr
    assert not out.parent.exists()  # the output's parent, which the job made, is gone too


def test_exported_files_are_readable_by_others(job):
    argv, out = job
    previous = os.umask(0o022)
    try:
        assert main(argv) == 0
    finally:
        os.umask(previous)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert "model.safetensors" in modes and "config.json" in modes
    assert set(modes.values()) == {0o644}, modes
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
