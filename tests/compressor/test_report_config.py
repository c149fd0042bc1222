import dataclasses

import pytest

from lmcompress.compressor.report import CompressionReport, LayerReport
from lmcompress.errors import ConfigError
from lmcompress.methods import METHODS, get_method
from lmcompress.methods.magnitude import MagnitudeConfig
from lmcompress.pipeline import RunOptions


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
    assert config.sparsity == "4:8" and config.include == ("model.*",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.sparsity = "2:4"
    assert MagnitudeConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ConfigError, match="unknown option"):
        MagnitudeConfig.from_dict({"sparsity": "2:4", "ratio": 3})
    with pytest.raises(ConfigError, match="non-empty"):
        MagnitudeConfig(exclude=("",))


def test_registry_is_explicit_and_unknown_method_is_named():
    assert METHODS["magnitude"].config_class is MagnitudeConfig
    with pytest.raises(ConfigError, match="unknown method 'foo'; available: .*magnitude"):
        get_method("foo")


def test_no_method_option_shadows_a_job_option():
    job = {f.name for f in dataclasses.fields(RunOptions)}
    for name, method in METHODS.items():
        fields = {f.name for f in dataclasses.fields(method.config_class)}
        assert not fields & job, (name, fields & job)
        assert method.config_class.method == name
