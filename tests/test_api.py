"""lmcompress.compress on in-memory tiny models: every one-shot pruner, return_stats, and the
errors a caller can make."""

from __future__ import annotations

import inspect
import json

import pytest
import torch
from conftest import VOCAB, make_tiny_model

import lmcompress
from lmcompress import compress
from lmcompress.compressor.method import Stats
from lmcompress.compressor.model.surgery import LayerSelection, weight_matrix
from lmcompress.compressor.report import CompressionReport
from lmcompress.errors import ConfigError

CONFIGS = {
    "magnitude": lmcompress.MagnitudeConfig(sparsity="2:4"),
    "wanda": lmcompress.WandaConfig(sparsity="2:4"),
    "sparsegpt": lmcompress.SparseGPTConfig(sparsity="2:4", calib_batch_size=2),
}
CALIB = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_compress_prunes_every_selected_layer_exactly_2_of_4(name, family):
    model = make_tiny_model(family)
    model.train()  # compress puts the model in eval mode itself
    report = compress(model, CONFIGS[name], CALIB)
    assert isinstance(report, CompressionReport) and report.method == name
    assert not model.training
    layers = LayerSelection().select(model)
    assert [layer.name for layer in report.layers] == list(layers)
    for layer in report.layers:
        W = weight_matrix(layers[layer.name])
        groups = (W != 0).reshape(-1, 4).sum(1)
        assert torch.all(groups <= 2), layer.name  # SparseGPT may zero a kept weight, not more
        assert layer.params_kept == W.numel() // 2 and layer.pattern == "2:4"
        assert layer.format == "nm_packed" and layer.format_options == {"n": 2, "m": 4}
    assert report.config == CONFIGS[name].to_dict()
    assert report.summary()["params_kept"] == report.params // 2


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_return_stats_gives_saveable_stats(name, tmp_path):
    model = make_tiny_model("llama")
    report, stats = compress(model, CONFIGS[name], CALIB, return_stats=True)
    assert isinstance(report, CompressionReport) and isinstance(stats, Stats)
    stats.save(tmp_path / "stats.safetensors")  # JSON meta, tensors only
    loaded = Stats.load(tmp_path / "stats.safetensors")
    assert loaded.meta == json.loads(json.dumps(stats.meta))  # tuples come back as lists


@pytest.mark.parametrize("name", ["wanda", "sparsegpt"])
def test_a_method_that_needs_data_refuses_to_run_without(name):
    model = make_tiny_model("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError, match=f"method '{name}' needs calibration data"):
        compress(model, CONFIGS[name])
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_magnitude_needs_no_data_and_ignores_none():
    model = make_tiny_model("llama")
    report = compress(model, lmcompress.MagnitudeConfig(sparsity=0.5))
    assert report.layers and all(layer.pattern == "0.5" for layer in report.layers)


def test_bad_options_fail_before_any_weight_changes():
    model = make_tiny_model("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError, match="no linear layer matches"):
        compress(model, lmcompress.MagnitudeConfig(include=("*.nothing",)))
    with pytest.raises(ConfigError, match="lm_head shares its weight"):
        compress(model, lmcompress.WandaConfig(include=("lm_head",)), CALIB)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_every_exported_name_resolves_is_documented_and_listed_by_dir():
    for name in lmcompress.__all__:
        value = getattr(lmcompress, name)
        assert value is not None, name
        if inspect.isclass(value) or inspect.isroutine(value):
            doc = value.__dict__.get("__doc__") if inspect.isclass(value) else value.__doc__
            assert doc and doc.strip(), f"{name} has no docstring"
            # a dataclass without one gets its signature as __doc__
            assert not doc.startswith(f"{name}("), f"{name} has no docstring"
        else:  # a value (METHODS): the package docstring says what it is
            assert f"``{name}``" in lmcompress.__doc__, name
    assert set(lmcompress.__all__) <= set(dir(lmcompress))
    assert lmcompress.run.__module__ == "lmcompress.jobs.run"
    expected = {
        *("load_model", "load_compressed", "save_compressed", "compress", "perplexity"),
        *("run", "RunOptions", "CompressionReport", "tokenize", "calibration_windows"),
    }
    assert expected <= set(lmcompress.__all__)


@pytest.mark.parametrize("name", sorted(lmcompress.METHODS))
def test_every_registered_method_has_its_config_exported(name):
    config_class = lmcompress.METHODS[name].config_class
    assert config_class.__name__ in lmcompress.__all__
    assert getattr(lmcompress, config_class.__name__) is config_class
    assert config_class.method == name
