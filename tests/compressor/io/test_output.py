"""OutputDir: every rule of an output directory, each checked once however many steps hold it.
Each test is the one that fails when its rule is skipped or run a second time."""

from __future__ import annotations

import errno
import os
import time

import pytest

import lmcompress.compressor.io.output as output_module
from lmcompress.compressor.io.output import OutputDir
from lmcompress.compressor.util import fsutil
from lmcompress.errors import ConfigError, LmcompressError


def _count(monkeypatch, module, name: str) -> list:
    """Record every call of ``module.name`` (then run it)."""
    calls, real = [], getattr(module, name)

    def spy(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return calls


@pytest.mark.parametrize(
    "output, source, relation",
    [("model", "model", "is"), ("model/out", "model", "is inside"), ("runs", "runs/m", "contains")],
)
def test_an_output_that_is_inside_or_around_an_input_is_refused(tmp_path, output, source, relation):
    (tmp_path / source).mkdir(parents=True)
    out = OutputDir(tmp_path / output, overwrite=True)  # even with --overwrite
    with pytest.raises(ConfigError, match=f"{relation} the input"):
        out.check([tmp_path / source])
    assert (tmp_path / source).is_dir()


def test_an_input_named_later_is_still_compared(tmp_path):
    """A later stage's inputs (its ``--prior-from``) are checked though the rest ran once."""
    (tmp_path / "a").mkdir()
    out = OutputDir(tmp_path / "a" / "out").check([tmp_path / "b"])
    with pytest.raises(ConfigError, match="is inside the input"):
        out.check([tmp_path / "a"])


def test_a_non_empty_output_needs_overwrite(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep")
    with pytest.raises(LmcompressError, match="not empty"):
        OutputDir(tmp_path / "out").check()
    OutputDir(tmp_path / "out", overwrite=True).check()
    with pytest.raises(ConfigError, match="exists and is not a directory"):
        OutputDir(tmp_path / "out" / "mine.txt", overwrite=True).check()


def test_the_debris_of_a_killed_run_is_removed(tmp_path):
    debris = tmp_path / ".out.tmp-abcd1234"  # an owner that cannot be checked, long abandoned
    debris.mkdir()
    old = time.time() - fsutil.UNCHECKABLE_STALE_AFTER_S - 60
    os.utime(debris, (old, old))
    OutputDir(tmp_path / "out").check()
    assert not debris.exists()


def test_each_rule_runs_once_however_many_steps_hold_it(tmp_path, monkeypatch):
    writable = _count(monkeypatch, output_module, "check_writable")
    swept = _count(monkeypatch, output_module, "sweep_stale")
    out = OutputDir(tmp_path / "out")
    with out.lock():  # the job's lock, then every stage's preflight, then the save
        out.check([tmp_path / "model"])
        out.check([tmp_path / "model"])
        with out.build() as tmp:
            (tmp / "file").write_text("x")
    assert len(writable) == 1 and len(swept) == 1
    assert (tmp_path / "out" / "file").read_text() == "x"


def test_a_second_job_on_the_same_output_is_refused(tmp_path):
    out = OutputDir(tmp_path / "out")
    with out.lock(), pytest.raises(ConfigError), OutputDir(tmp_path / "out").lock():
        pass


def test_a_full_disk_is_one_line_once_and_the_temporary_directory_is_gone(tmp_path, monkeypatch):
    guards = _count(monkeypatch, output_module, "disk_full_as_error")
    out = OutputDir(tmp_path / "out")
    with pytest.raises(LmcompressError, match="no space left") as caught:
        with out.guarded(), out.build() as tmp:  # the job's guard around the save's
            (tmp / "part").write_text("half")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert len(guards) == 1 and "\n" not in str(caught.value)
    assert list(tmp_path.iterdir()) == []  # no half-written output, no temporary sibling
