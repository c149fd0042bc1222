"""Bad input to ``compress-model eval``, and what depends on the machine (a read-only mount,
the GPUs it has): one line on stderr, exit 2, before any weight is loaded. The device cases
pretend a machine (``torch.cuda`` patched), so they hold with or without a GPU."""

from __future__ import annotations

import subprocess

import pytest
import torch

import lmcompress.jobs.run as pipeline
from lmcompress.cli.main import main


def _no_loading(*_args, **_kwargs):
    raise AssertionError("the model was loaded before the error")


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(f"Document {i}. The quick brown fox." for i in range(60)))
    return path


def test_read_only_mount_is_refused_before_loading(
    tiny_checkpoint, corpus, tmp_path, monkeypatch, capsys
):
    target = tmp_path / "ro"
    target.mkdir()
    mounted = subprocess.run(
        ["mount", "-o", "bind,ro", str(target), str(target)], capture_output=True, check=False
    )
    if mounted.returncode != 0:
        pytest.skip("cannot bind-mount read-only here (needs root)")
    try:
        monkeypatch.setattr(pipeline, "load_model", _no_loading)
        code = main([str(tiny_checkpoint), "--eval", str(corpus), "-o", str(target / "out")])
        err = capsys.readouterr().err.strip()
        assert code == 2 and "cannot write" in err and "Read-only file system" in err, err
    finally:
        subprocess.run(["umount", str(target)], check=False)


EVAL_CASES = {
    "missing": (["{tmp}/nope"], "not found"),
    "seq-len beyond positions": (["{ckpt}", "--seq-len", "129"], "maximum of 128 positions"),
    "cuda without cuda": (["{ckpt}", "--device", "cuda"], "this torch has no CUDA"),
    "unknown corpus": (["{ckpt}", "--seq-len", "32", "--data", "wikitext-999"], "wikitext-999"),
    "unknown lm-eval task": (
        ["{ckpt}", "--seq-len", "32", "--lm-eval-tasks", "nonexistent_task"],
        "nonexistent",
    ),
}


@pytest.mark.parametrize("case", list(EVAL_CASES))
def test_eval_bad_input_is_one_line_before_loading(
    case, tiny_checkpoint, tmp_path, monkeypatch, capsys
):
    import lmcompress.compressor.model.loading as models

    argv, message = EVAL_CASES[case]
    argv = [a.format(tmp=tmp_path, ckpt=tiny_checkpoint) for a in argv]
    monkeypatch.setattr(models, "load_model", _no_loading)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # any machine: no GPU
    capsys.readouterr()
    code = main(["eval", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith("compress-model: error:") and "\n" not in err and message in err, err


@pytest.mark.parametrize("job", ["compress", "eval"])
def test_a_gpu_index_past_the_visible_ones_is_one_line_before_loading(
    job, tiny_checkpoint, corpus, monkeypatch, capsys
):
    """A machine with one GPU (patched, so any machine is one): ``cuda:1`` names the count."""
    import lmcompress.compressor.model.loading as models

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(models, "load_model", _no_loading)
    monkeypatch.setattr(pipeline, "load_model", _no_loading)
    argv = [str(tiny_checkpoint), "--seq-len", "32", "--device", "cuda:1"]
    argv = ["eval", *argv] if job == "eval" else [*argv, "--eval", str(corpus)]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("compress-model: error:") and "\n" not in err, err
    assert "device cuda:1: only 1 cuda device(s) visible" in err, err
