"""The Python API's argument checks: an argument of the wrong kind is one line naming it
(``ArgumentError``, both a ``ConfigError`` and a ``TypeError``), raised before any work —
not an ``AttributeError`` from deep inside the job."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model

import lmcompress as L
from lmcompress.compressor.io import load as load_module
from lmcompress.errors import ArgumentError, ConfigError

RUN = L.RunOptions(checkpoint="smollm2-135m")
CONFIG = L.MagnitudeConfig(sparsity="2:4")

CASES = {
    "run: config a dict": (lambda: L.run(RUN, {"method": "magnitude"}), "config"),
    "run: config a string": (lambda: L.run(RUN, "magnitude"), "config"),
    "run: a list holding a dict": (lambda: L.run(RUN, [CONFIG, {"method": "int8"}]), "config[1]"),
    "run: options None": (lambda: L.run(None, CONFIG), "options"),
    "run: options a dict": (lambda: L.run({"checkpoint": "x"}, CONFIG), "options"),
    "compress: config a dict": (
        lambda: L.compress(make_tiny_model("llama"), {"method": "magnitude"}),
        "config",
    ),
    "compress: model None": (lambda: L.compress(None, CONFIG), "model"),
    "compress: data a list": (
        lambda: L.compress(make_tiny_model("llama"), CONFIG, data=[[1, 2]]),
        "data",
    ),
    "save_compressed: report None": (
        lambda: L.save_compressed(make_tiny_model("llama"), "/tmp/x", None),
        "report",
    ),
    "load_compressed: None": (lambda: L.load_compressed(None), "out_dir"),
    "load_compressed: an int": (lambda: L.load_compressed(3), "out_dir"),
    "load_compressed: empty path": (lambda: L.load_compressed(""), "out_dir"),
    "load_model: None": (lambda: L.load_model(None), "checkpoint"),
    "perplexity: ids a list": (
        lambda: L.perplexity(make_tiny_model("llama"), [1, 2, 3], 8),
        "token_ids",
    ),
    "perplexity: seq_len a string": (
        lambda: L.perplexity(make_tiny_model("llama"), torch.arange(20), "8"),
        "seq_len",
    ),
    "calibration_windows: nsamples a float": (
        lambda: L.calibration_windows(torch.arange(100), 2.0, 8),
        "nsamples",
    ),
    "tokenize: source a path-like list": (lambda: L.tokenize(None, ["wiki"]), "source"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_wrong_kind_of_argument_is_one_line_naming_it(case):
    call, name = CASES[case]
    with pytest.raises(ArgumentError) as info:
        call()
    message = str(info.value)
    assert message.startswith(f"{name} ") and "\n" not in message
    assert isinstance(info.value, ConfigError) and isinstance(info.value, TypeError)


def test_a_bool_is_not_taken_for_an_int():
    with pytest.raises(ArgumentError, match="nsamples"):
        L.calibration_windows(torch.arange(100), True, 8)


def test_load_compressed_on_a_gpu_less_host_refuses_cuda_before_reading(tmp_path, monkeypatch):
    """A real export, so that the device is the only thing wrong; nothing is read first."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    model = make_tiny_model("llama")
    report = L.compress(model, CONFIG)
    L.save_compressed(model, tmp_path / "out", report)

    def no_reading(*_args, **_kwargs):
        raise AssertionError("the manifest was read before the device was checked")

    monkeypatch.setattr(load_module, "read_manifest", no_reading)
    with pytest.raises(ConfigError, match="device cuda"):
        L.load_compressed(tmp_path / "out", device="cuda")
    monkeypatch.undo()
    loaded, _, _ = L.load_compressed(str(tmp_path / "out"))  # a str path is fine
    assert isinstance(loaded, torch.nn.Module)


def test_right_arguments_still_run():
    """The checks refuse only wrong kinds: a list of configs and a tuple are stages."""
    from lmcompress.compressor.util.arguments import one_or_more

    assert one_or_more("config", CONFIG, L.MethodConfig, "a config") == [CONFIG]
    assert one_or_more("config", (CONFIG, CONFIG), L.MethodConfig, "a config") == [CONFIG] * 2
    ids = torch.arange(50)
    assert L.calibration_windows(ids, 2, 8).shape == (2, 8)
