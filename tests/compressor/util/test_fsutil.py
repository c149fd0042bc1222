"""atomic_dir / atomic_file: nothing half-written is ever visible, nothing a killed run left
behind survives the next write, and what is written has ordinary permissions."""

import logging
import os
import stat
import subprocess
import time

import pytest
import torch
from safetensors.torch import save_file

from lmcompress.cli.main import Terminated
from lmcompress.compressor.util.fsutil import (
    UNCHECKABLE_STALE_AFTER_S,
    _host,
    atomic_dir,
    atomic_file,
    sweep_stale,
)

STALE = "removed 1 stale temporary item(s) left by a killed run"


@pytest.fixture
def dead_pid():
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


@pytest.fixture
def live_pid():
    child = subprocess.Popen(["sleep", "60"])
    yield child.pid
    child.kill()
    child.wait()


def _sibling(parent, name, with_file=True):
    path = parent / name
    path.mkdir()
    if with_file:
        (path / "model.safetensors").write_bytes(b"partial")
    return path


def _mode(path):
    return stat.S_IMODE(path.stat().st_mode)


def _age(path, seconds):
    then = time.time() - seconds
    for item in [path, *path.rglob("*")]:
        os.utime(item, (then, then))


def test_sibling_of_a_dead_pid_is_removed_with_one_warning(tmp_path, dead_pid, caplog):
    tmp_dir = _sibling(tmp_path, f".out.tmp-{dead_pid}-{_host()}-abcd1234")
    trash = _sibling(tmp_path, f".out.old-{dead_pid}-{_host()}-efgh5678")
    with caplog.at_level(logging.WARNING, "lmcompress.compressor.util.fsutil"):
        with atomic_dir(tmp_path / "out") as tmp:
            (tmp / "a.txt").write_text("new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert (tmp_path / "out" / "a.txt").read_text() == "new"
    assert not tmp_dir.exists() and not trash.exists()
    expected = f"removed 2 stale temporary item(s) left by a killed run next to {tmp_path / 'out'}"
    assert [r.getMessage() for r in caplog.records] == [expected]


def test_sibling_of_a_live_pid_is_kept(tmp_path, live_pid, caplog):
    kept = _sibling(tmp_path, f".out.tmp-{live_pid}-{_host()}-abcd1234")
    with caplog.at_level(logging.WARNING, "lmcompress.compressor.util.fsutil"):
        assert sweep_stale(tmp_path / "out") == []
        with atomic_dir(tmp_path / "out", keep_existing=True) as tmp:
            (tmp / "a.txt").write_text("ours")
    assert (kept / "model.safetensors").read_bytes() == b"partial"
    assert (tmp_path / "out" / "a.txt").read_text() == "ours"
    assert caplog.records == []


def test_unrelated_names_are_never_touched(tmp_path, dead_pid):
    names = [
        f".other.tmp-{dead_pid}-{_host()}-abcd1234",  # another target's
        f".out.tmp-{dead_pid}-{_host()}-toolongname",  # not a mkdtemp suffix
        ".out.tmp-my-backup",
        "out.tmp-1-x-abcd1234",
        "out2",
    ]
    for name in names:
        _sibling(tmp_path, name)
        _age(tmp_path / name, 2 * UNCHECKABLE_STALE_AFTER_S)
    assert sweep_stale(tmp_path / "out") == []
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)


@pytest.mark.parametrize(
    "name",
    [
        ".out.tmp-abcd1234",
        ".out.old-abcd1234",
        ".out.abcd1234.tmp",
        ".out.tmp-1-otherhost-abcd1234",
    ],
)
def test_uncheckable_owner_removed_only_once_abandoned(tmp_path, name, caplog):
    """Names of earlier versions (no pid) and other hosts' (pid means nothing here)."""
    path = _sibling(tmp_path, name)
    with caplog.at_level(logging.WARNING, "lmcompress.compressor.util.fsutil"):
        assert sweep_stale(tmp_path / "out") == []
    assert path.exists()
    assert "may still be writing" in caplog.text and name in caplog.text

    _age(path, UNCHECKABLE_STALE_AFTER_S + 60)
    (path / "model.safetensors").touch()  # still being written: kept
    assert sweep_stale(tmp_path / "out") == [] and path.exists()

    _age(path, UNCHECKABLE_STALE_AFTER_S + 60)
    caplog.clear()
    with caplog.at_level(logging.WARNING, "lmcompress.compressor.util.fsutil"):
        assert sweep_stale(tmp_path / "out") == [path]
    assert not path.exists() and STALE in caplog.text


def test_output_moved_aside_by_a_killed_replace_is_put_back(tmp_path, dead_pid):
    """Killed between the two renames of a replace: the old output is in the trash."""
    trash = tmp_path / f".out.old-{dead_pid}-{_host()}-abcd1234"
    trash.mkdir()
    _sibling(trash, "old")
    _sibling(tmp_path, f".out.tmp-{dead_pid}-{_host()}-efgh5678")  # the new, complete one
    assert len(sweep_stale(tmp_path / "out")) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == b"partial"


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002], ids=oct)
def test_everything_written_gets_ordinary_modes(tmp_path, umask):
    previous = os.umask(umask)
    try:
        with atomic_dir(tmp_path / "out") as tmp:
            save_file({"w": torch.zeros(2)}, str(tmp / "model.safetensors"))  # made 0600
            (tmp / "config.json").write_text("{}")
            (tmp / "sub").mkdir(mode=0o700)
            save_file({"w": torch.zeros(2)}, str(tmp / "sub" / "more.safetensors"))
        with atomic_file(tmp_path / "file.txt") as handle:
            handle.write("x")
    finally:
        os.umask(previous)
    out = tmp_path / "out"
    files = [out / "model.safetensors", out / "config.json", out / "sub" / "more.safetensors"]
    assert [_mode(p) for p in files] == [0o666 & ~umask] * 3
    assert _mode(out) == _mode(out / "sub") == 0o777 & ~umask
    assert _mode(tmp_path / "file.txt") == 0o666 & ~umask


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt, Terminated])
def test_an_exception_inside_leaves_nothing_and_the_old_output_intact(tmp_path, error):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "a.txt").write_text("old")
    (tmp_path / "file.txt").write_text("old")
    with pytest.raises(error), atomic_dir(tmp_path / "out") as tmp:
        (tmp / "a.txt").write_text("new")
        raise error("stop")
    with pytest.raises(error), atomic_file(tmp_path / "file.txt") as handle:
        handle.write("new")
        raise error("stop")
    with pytest.raises(error), atomic_dir(tmp_path / "fresh") as tmp:
        raise error("stop")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt", "out"]
    assert (tmp_path / "out" / "a.txt").read_text() == "old"
    assert (tmp_path / "file.txt").read_text() == "old"


def test_replace_leaves_only_the_new_output(tmp_path):
    for text in ["first", "second"]:
        with atomic_dir(tmp_path / "out") as tmp:
            (tmp / "a.txt").write_text(text)
        with atomic_file(tmp_path / "file.txt") as handle:
            handle.write(text)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt", "out"]
    assert (tmp_path / "out" / "a.txt").read_text() == "second"
    assert (tmp_path / "file.txt").read_text() == "second"
    with pytest.raises(FileExistsError), atomic_dir(tmp_path / "out", replace=False):
        pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt", "out"]


def test_temporaries_carry_the_owner_pid(tmp_path):
    with atomic_dir(tmp_path / "out") as tmp:
        assert tmp.name.startswith(f".out.tmp-{os.getpid()}-{_host()}-")
        assert sweep_stale(tmp_path / "out") == []  # our own: never swept
    with atomic_file(tmp_path / "file.txt"):
        (temporary,) = [p.name for p in tmp_path.iterdir() if p.name.startswith(".file")]
        assert temporary.startswith(f".file.txt.tmp-{os.getpid()}-{_host()}-")
