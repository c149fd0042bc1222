"""OutputDir: every rule of an output directory, each checked once however many steps hold it.
Each test is the one that fails when its rule is skipped or run a second time."""

from __future__ import annotations

import errno
import os
import shutil
import time

import pytest

import lmcompress.compressor.io.output as output_module
from lmcompress.compressor.io.output import OutputDir
from lmcompress.compressor.util import fsutil, locks
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


# --- one writer per output path, nested paths included ---------------------------------------


def test_a_job_inside_or_around_a_running_one_is_refused(tmp_path):
    """Two OutputDir locks in one process conflict as two processes' do (flock is per open
    file): ``a/b`` held, then ``a/b``, ``a`` and ``a/b/c`` are refused, the sibling ``a/c``
    is not."""
    with OutputDir(tmp_path / "a" / "b").lock():
        for other, says in [
            ("a/b", "is being written by another run (pid"),
            ("a", "contains the output of another running job (pid"),
            ("a/b/c", "is inside " + str(tmp_path / "a" / "b") + ", which another run"),
        ]:
            with pytest.raises(ConfigError, match="wait for it to finish") as caught:
                with OutputDir(tmp_path / other).lock():
                    pass
            assert says in str(caught.value) and "\n" not in str(caught.value)
        with OutputDir(tmp_path / "a" / "c").lock():
            pass
    with OutputDir(tmp_path / "a").lock():  # all released
        pass


def test_no_output_holds_a_lock_so_overwrite_cannot_delete_one(tmp_path):
    """The lock of ``a/b`` lives outside ``a``: removing ``a`` (an ``--overwrite`` of it)
    leaves it, and a third job on ``a/b`` is still refused."""
    with OutputDir(tmp_path / "a" / "b").lock():
        assert not locks.lock_path(tmp_path / "a" / "b").is_relative_to(tmp_path)
        (tmp_path / "a" / "b").mkdir(parents=True)
        shutil.rmtree(tmp_path / "a")
        with pytest.raises(ConfigError, match="being written by another run"):
            with OutputDir(tmp_path / "a" / "b").lock():
                pass
    assert not locks.lock_path(tmp_path / "a" / "b").exists()  # released and removed


# --- what appeared in the output while the job ran is never deleted --------------------------


@pytest.mark.parametrize("existed", [True, False])
def test_an_output_written_into_meanwhile_is_not_replaced(tmp_path, existed):
    out = tmp_path / "out"
    if existed:
        out.mkdir()
        (out / "old.txt").write_text("old export")
    output = OutputDir(out, overwrite=True).check()  # the job starts
    out.mkdir(exist_ok=True)
    (out / "notes.txt").write_text("written during the job")
    with pytest.raises(fsutil.OutputChanged, match="notes.txt") as caught:
        with output.build() as tmp:
            (tmp / "config.json").write_text("{}")
    assert (out / "notes.txt").read_text() == "written during the job"
    assert (out / "old.txt").exists() == existed
    kept = caught.value.kept
    assert kept.parent == tmp_path and kept.name.startswith("out.new-")
    assert (kept / "config.json").read_text() == "{}" and str(kept) in str(caught.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", kept.name])


def test_a_file_rewritten_meanwhile_is_kept_and_an_untouched_output_is_replaced(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "a.txt").write_text("one")
    output = OutputDir(out, overwrite=True).check()
    (out / "a.txt").write_text("a different size")
    with pytest.raises(fsutil.OutputChanged, match="a.txt was rewritten"):
        with output.build() as tmp:
            (tmp / "config.json").write_text("{}")
    assert (out / "a.txt").read_text() == "a different size"
    untouched = OutputDir(tmp_path / "other", overwrite=True)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "old.txt").write_text("old export")
    with untouched.check().build() as tmp:
        (tmp / "config.json").write_text("{}")
    assert sorted(p.name for p in (tmp_path / "other").iterdir()) == ["config.json"]


def test_a_lock_directory_that_cannot_be_made_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("LMCOMPRESS_LOCKS", str(tmp_path / "file" / "locks"))
    with pytest.raises(ConfigError, match="cannot make the lock directory .*LMCOMPRESS_LOCKS"):
        with OutputDir(tmp_path / "out").lock():
            pass
