import dataclasses
import json
import typing

import pytest

from lmcompress.compressor import config as config_module
from lmcompress.compressor.config import Sparsity
from lmcompress.compressor.options import option_fields
from lmcompress.compressor.report import CompressionReport, LayerReport
from lmcompress.errors import ConfigError
from lmcompress.jobs.options import RunOptions, SaveDtype
from lmcompress.methods import METHODS, get_method, pruning
from lmcompress.methods.magnitude import MagnitudeConfig
from lmcompress.methods.sparsegpt import SparseGPTConfig
from lmcompress.methods.sparsegpt.config import HessianDtype


def test_report_json_round_trip():
    report = CompressionReport(
        method="magnitude",
        config={"sparsity": "2:4"},
        seconds=1.5,
        model_params=1000,
        layers=[
            LayerReport(
                "a.b",
                (8, 16),
                128,
                64,
                512,
                288,
                sparsity=0.5,
                pattern="2:4",
                rel_error=0.3,
                seconds=0.1,
            )
        ],
        extra={"curve": [1, 2]},
    )
    again = CompressionReport.from_json(report.to_json())
    assert again == report
    assert again.summary() == {
        "method": "magnitude",
        "layers": 1,
        "params_compressed_layers": 128,
        "params_kept": 64,
        "model_params": 1000,
        "model_params_after": 936,
        "bytes_dense": 512,
        "bytes_compressed": 288,
        "seconds": 1.5,
    }


def test_config_is_frozen_validated_and_round_trips():
    config = MagnitudeConfig(sparsity="4 : 8", include=["model.*"])
    assert config.sparsity == Sparsity(n=4, m=8) and config.include == ("model.*",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.sparsity = Sparsity(n=2, m=4)
    recipe = config.to_dict()
    assert recipe["sparsity"] == "4:8" and recipe["include"] == ["model.*"]  # text, as written
    assert json.loads(json.dumps(recipe)) == recipe
    assert MagnitudeConfig.from_dict(recipe) == config
    with pytest.raises(ConfigError, match="unknown option"):
        MagnitudeConfig.from_dict({"sparsity": "2:4", "ratio": 3})
    with pytest.raises(ConfigError, match="non-empty"):
        MagnitudeConfig(exclude=("",))


@pytest.mark.parametrize(
    ("given", "expected"),
    [("2:4", Sparsity(2, 4)), (0.5, Sparsity(ratio=0.5)), ("30%", Sparsity(ratio=0.3))],
)
def test_sparsity_is_parsed_once_on_construction(given, expected, monkeypatch):
    config = MagnitudeConfig(sparsity=given, layer_sparsity=("*.q_proj=1:4", "*.mlp.*=25%"))
    assert config.sparsity == expected and config.pattern is config.sparsity
    assert MagnitudeConfig(sparsity=expected) == MagnitudeConfig(sparsity=str(expected))
    assert config.layer_rules == (("*.q_proj", Sparsity(1, 4)), ("*.mlp.*", Sparsity(ratio=0.25)))
    assert config.layer_sparsity == ("*.q_proj=1:4", "*.mlp.*=0.25")  # normalised text

    def no_parsing(_value):
        raise AssertionError("sparsity parsed again after construction")

    monkeypatch.setattr(pruning, "parse_sparsity", no_parsing)
    monkeypatch.setattr(config_module, "parse_sparsity", no_parsing)
    assert config.sparsity_of("model.layers.0.self_attn.q_proj") == Sparsity(1, 4)
    assert config.sparsity_of("model.layers.0.mlp.up_proj") == Sparsity(ratio=0.25)
    assert config.sparsity_of("model.layers.0.self_attn.k_proj") == expected


def test_sparsity_constructed_directly_is_validated():
    with pytest.raises(ConfigError, match="impossible N:M"):
        Sparsity(n=4, m=4)
    with pytest.raises(ConfigError, match="between 0 and 1"):
        Sparsity(ratio=1.0)


def test_literal_fields_are_the_one_list_of_allowed_values():
    assert typing.get_args(SaveDtype) == ("auto", "float32", "float16", "bfloat16")
    for value in typing.get_args(SaveDtype):
        assert RunOptions(save_dtype=value).save_dtype == value
    with pytest.raises(ConfigError, match="save_dtype must be one of auto, float32"):
        RunOptions(save_dtype="int3")
    assert typing.get_args(HessianDtype) == ("float32", "float64")
    assert SparseGPTConfig(hessian_dtype="float64").hessian_dtype == "float64"
    with pytest.raises(ConfigError, match="hessian_dtype must be one of float32, float64"):
        SparseGPTConfig(hessian_dtype="float16")
    with pytest.raises(ConfigError, match="hessian_dtype must be one of"):
        SparseGPTConfig.from_dict({"hessian_dtype": "half"})


def test_registry_is_explicit_and_unknown_method_is_named():
    assert METHODS["magnitude"].config_class is MagnitudeConfig
    with pytest.raises(ConfigError, match="unknown method 'foo'; available: .*magnitude"):
        get_method("foo")


def test_no_method_option_shadows_a_job_option():
    job = {o.name for o in option_fields(RunOptions)}
    for name, method in METHODS.items():
        fields = {o.name for o in option_fields(method.config_class)}  # nested groups flat
        assert not fields & job, (name, fields & job)
        assert method.config_class.method == name
