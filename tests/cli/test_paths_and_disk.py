"""Every path a job writes is checked before any work, a second writer of one output is
refused, and a full disk is one line that leaves nothing (issue 23, points 1, 3 and 6).

The path cases run ``main`` in this process with model loading forbidden; the concurrent
writers are two real ``compress-model`` processes; the full disks are small tmpfs mounts
(skipped where this machine cannot mount one), written by ``main`` in this process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import lmcompress.jobs.run as pipeline
from lmcompress.cli.main import main
from lmcompress.compressor.util.locks import lock_path

TEXT = "\n\n".join(f"Document {i}. The quick brown fox jumps over the lazy dog." for i in range(60))


def _no_loading(*_args, **_kwargs):
    raise AssertionError("the model was loaded before the error")


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    return path


def _job(checkpoint, corpus, *extra: str) -> list[str]:
    """The job's argv: these defaults, less those ``extra`` gives (a flag given twice is
    refused), then ``extra``."""
    defaults = {"--eval": str(corpus), "--calib": str(corpus), "--seq-len": "32"}
    defaults.update({"--nsamples": "4", "--eval-tokens": "256"})
    if "--streaming" in extra:  # streamed: no scores
        del defaults["--eval"]
    given = {arg.split("=")[0] for arg in extra}
    common = [x for flag, value in defaults.items() if flag not in given for x in (flag, value)]
    return [str(checkpoint), *common, *extra]


def _one_line_error(argv, capsys) -> str:
    """Run ``main(argv)``: exit 2 and exactly one stderr line (no INFO line before it)."""
    capsys.readouterr()
    with torch.no_grad():
        code = main(argv)
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert code == 2, err
    assert captured.out == "" and "\n" not in err, err
    assert err.startswith("compress-model: error:"), err
    return err


def _mismatched(tmp_path, good):
    path = tmp_path / "mismatched"
    path.mkdir()
    for item in good.iterdir():
        (path / item.name).write_bytes(item.read_bytes())
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] = 48
    (path / "config.json").write_text(json.dumps(config))
    return path


PATH_CASES = {
    # name -> (flags, part of the message); {tmp} is the test's directory
    "-o a dangling symlink": (["-o", "{tmp}/dangling"], "is a dangling symlink"),
    "-o under a dangling symlink": (["-o", "{tmp}/dangling/out"], "is a dangling symlink"),
    "-o a symlink loop": (["-o", "{tmp}/loop-a"], "a symlink loop"),
    "-o a 300-character name": (["-o", "{tmp}/" + "x" * 300], "longer than 255 bytes"),
    "-o longer than PATH_MAX": (
        ["-o", "{tmp}/" + "/".join(["d" * 200] * 25)],
        "longer than the system allows",
    ),
    "--offload-activations under /proc": (
        ["--streaming", "--offload-activations", "/proc/lmcompress-act", "-o", "{tmp}/out"],
        "cannot write in /proc",
    ),
    "--offload-activations a file": (
        ["--streaming", "--offload-activations", "{tmp}/a-file", "-o", "{tmp}/out"],
        "exists and is not a directory",
    ),
    "--offload-activations under a file": (
        ["--streaming", "--offload-activations", "{tmp}/a-file/act", "-o", "{tmp}/out"],
        "is a file, not a directory",
    ),
    "--checkpoint-dir a file": (
        ["--method", "maskllm", "--checkpoint-every", "1", "--checkpoint-dir", "{tmp}/a-file"],
        "--checkpoint-dir",
    ),
    "config.json disagrees with the weights": (
        ["{mismatched}", "-o", "{tmp}/out"],
        "config.json disagrees with the weights: model.layers.0.mlp",
    ),
}


@pytest.mark.parametrize("case", list(PATH_CASES))
def test_bad_path_is_one_line_before_any_work(
    case, tmp_path, tiny_checkpoint, corpus, monkeypatch, capsys
):
    (tmp_path / "a-file").write_text("x")
    os.symlink(tmp_path / "nowhere" / "x", tmp_path / "dangling")
    os.symlink(tmp_path / "loop-b", tmp_path / "loop-a")
    os.symlink(tmp_path / "loop-a", tmp_path / "loop-b")
    mismatched = _mismatched(tmp_path, tiny_checkpoint)
    flags, message = PATH_CASES[case]
    flags = [f.format(tmp=tmp_path, mismatched=mismatched) for f in flags]
    checkpoint = tiny_checkpoint
    if flags[0] == str(mismatched):
        checkpoint, flags = mismatched, flags[1:]
    if "-o" not in flags:
        flags = [*flags, "-o", str(tmp_path / "out")]
    before = sorted(p.name for p in tmp_path.iterdir())
    monkeypatch.setattr(pipeline, "load_model", _no_loading)
    err = _one_line_error(_job(checkpoint, corpus, *flags), capsys)
    assert message in err, err
    assert len(err) < 400, err  # a long path is shortened, not quoted whole
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written, no lock


SHORT_TEXT_CASES = {
    # name -> (flags, part of the message): found before the model loads, so no INFO line
    # (the memory estimate) and no progress bar comes before the error
    "3-token --calib": (["--method", "wanda", "--calib", "{tmp}/three.txt"], "too short"),
    "--eval-tokens 1": (["--eval-tokens", "1"], "fewer than one window"),
    "empty --eval file": (["--eval", "{tmp}/empty.txt"], "is empty"),
}


@pytest.mark.parametrize("case", list(SHORT_TEXT_CASES))
def test_short_text_is_one_line_without_the_memory_line(
    case, tmp_path, tiny_checkpoint, corpus, monkeypatch, capsys
):
    (tmp_path / "three.txt").write_text("a b c")
    (tmp_path / "empty.txt").write_text("")
    flags, message = SHORT_TEXT_CASES[case]
    flags = [f.format(tmp=tmp_path) for f in flags]
    monkeypatch.setattr(pipeline, "load_model", _no_loading)
    err = _one_line_error(_job(tiny_checkpoint, corpus, *flags, "-o", str(tmp_path / "o")), capsys)
    assert message in err, err


def test_cache_directory_that_is_a_file_is_one_line_before_any_work(
    tmp_path, corpus, monkeypatch, capsys
):
    """The built-in model is cached as safetensors on first use: a cache that cannot be
    written is refused up front, not after the GGUF was read."""
    (tmp_path / "cache").write_text("x")
    monkeypatch.setenv("LMCOMPRESS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(pipeline, "load_model", _no_loading)
    err = _one_line_error(_job("smollm2-135m", corpus, "-o", str(tmp_path / "out")), capsys)
    assert "cache directory" in err and "exists and is not a directory" in err, err


def test_a_failed_load_prints_no_transformers_report(tmp_path, tiny_checkpoint, capsys):
    """Past the up-front checks (here: called directly), a config/weights mismatch is still
    one error, with the weight named, and nothing of transformers' load report."""
    from lmcompress.compressor.model.loading import load_model
    from lmcompress.errors import ModelLoadError

    mismatched = _mismatched(tmp_path, tiny_checkpoint)
    capsys.readouterr()
    with pytest.raises(ModelLoadError, match="config.json disagrees with the weights: model"):
        load_model(mismatched)
    assert "LOAD REPORT" not in capsys.readouterr().err


# --- concurrent writers ---------------------------------------------------------------------


def _cli(*argv: str) -> list[str]:
    return [sys.executable, "-m", "lmcompress.cli.main", *argv]


def test_second_writer_of_one_output_is_refused_naming_the_first(
    tmp_path, tiny_checkpoint, corpus, capfd
):
    """The first writer trains (long) in another process; the second, ``main`` in this one,
    names the same -o: it exits 2 in one line naming the first's pid, and the first is not
    disturbed."""
    out = tmp_path / "out"
    argv = _job(tiny_checkpoint, corpus, "--method", "maskllm", "--steps", "100000")
    first = subprocess.Popen(
        _cli(*argv, "-o", str(out)), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 60
        while not lock_path(out).exists():
            assert first.poll() is None and time.monotonic() < deadline, "no lock taken"
            time.sleep(0.1)
        capfd.readouterr()
        second = main(_job(tiny_checkpoint, corpus, "-o", str(out)))
        err = capfd.readouterr().err
        lines = err.strip().splitlines()
        assert second == 2 and len(lines) == 1, err
        assert "is being written by another run" in lines[0], lines[0]
        assert f"pid {first.pid} on" in lines[0], lines[0]
        assert first.poll() is None  # the first goes on
    finally:
        first.send_signal(signal.SIGTERM)
        code = first.wait(timeout=60)
    assert code == 143
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["corpus.txt", "tiny-llama"]
    )  # no output, no lock, no temporary directory


def test_lock_of_a_killed_writer_does_not_block_the_next(tmp_path, tiny_checkpoint, corpus):
    """SIGKILL leaves the lock file; the kernel released its lock: the next run takes it."""
    out = tmp_path / "out"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from lmcompress.compressor.util.locks import output_lock\n"
            f"with output_lock({str(out)!r}):\n    print('held', flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "held"
    holder.kill()
    holder.wait()
    assert lock_path(out).exists()
    code = main(_job(tiny_checkpoint, corpus, "--skip-dense", "-q", "-o", str(out)))
    assert code == 0 and (out / "config.json").is_file()
    assert not lock_path(out).exists()


# --- full disks -------------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A 64 kB tmpfs: smaller than any tiny model's export."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


def _cli_error(argv: list[str], capfd, caplog) -> str:
    """The one error line of a CLI run in this process, its stderr read at the descriptor;
    with ``--force``, its warning logged first (pytest's log capture holds it here)."""
    capfd.readouterr()
    caplog.clear()
    code = main([str(arg) for arg in argv])
    stderr = capfd.readouterr().err
    lines = [line for line in stderr.splitlines() if line.strip()]
    if "--force" in argv:
        warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert any("going on (--force)" in message for message in warned), warned
    assert code == 2 and len(lines) == 1, stderr[-3000:]
    assert lines[0].startswith("compress-model: error:"), lines[0]
    return lines[0]


@pytest.mark.parametrize("streaming", [False, True], ids=["in memory", "streaming"])
def test_output_larger_than_the_free_space_is_refused_up_front(
    small_disk, tiny_checkpoint, corpus, streaming, capfd, caplog
):
    flags = ["--streaming"] if streaming else []
    err = _cli_error(
        _job(tiny_checkpoint, corpus, *flags, "-o", str(small_disk / "out")), capfd, caplog
    )
    assert "not enough disk space" in err and "--force" in err, err
    assert list(small_disk.iterdir()) == []


@pytest.mark.parametrize("streaming", [False, True], ids=["in memory", "streaming"])
def test_disk_full_at_write_is_one_line_and_leaves_nothing(
    small_disk, tiny_checkpoint, corpus, streaming, capfd, caplog
):
    """``--force`` past the free-space check: the disk fills during the save (or the streamed
    writes); one line with the path, exit 2, nothing left on the disk."""
    flags = ["--streaming"] if streaming else []
    out = small_disk / "out"
    err = _cli_error(
        _job(tiny_checkpoint, corpus, *flags, "--force", "-q", "-o", str(out)), capfd, caplog
    )
    assert "no space left on the device writing" in err and str(out) in err, err
    assert list(small_disk.iterdir()) == []


def test_offload_to_a_full_disk_is_one_line_and_leaves_nothing(
    small_disk, tmp_path, tiny_checkpoint, corpus, capfd, caplog
):
    offload = small_disk / "act"
    argv = _job(tiny_checkpoint, corpus, "--method", "wanda", "--streaming", "--nsamples", "64")
    argv += ["--offload-activations", str(offload), "-o", str(tmp_path / "out")]
    err = _cli_error(argv, capfd, caplog)
    assert "not enough disk space" in err and "--offload-activations" in err, err
    err = _cli_error([*argv, "--force", "-q"], capfd, caplog)
    assert "no space left on the device writing" in err and str(offload) in err, err
    assert list(small_disk.iterdir()) == []
    assert not (tmp_path / "out").exists()
