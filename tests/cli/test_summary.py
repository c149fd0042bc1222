"""What ``compress-model`` prints at the end of a job: the layer count says how many of the
selected layers the method really changed."""

from __future__ import annotations

from lmcompress.cli.summary import print_summary
from lmcompress.compressor.report import CompressionReport, LayerReport


def _layer(name: str, kept: int, **kwargs) -> LayerReport:
    return LayerReport(name, (8, 8), 64, kept, 256, kept * 4, **kwargs)


def _print(capsys, layers: list[LayerReport]) -> str:
    report = CompressionReport("svd-llm", {"method": "svd-llm"}, layers, model_params=1000)
    results = {
        "report": report, "checkpoint": "tiny", "compressed": {}, "seconds": 1.0,
        "options": {"dtype": "float32"},
    }  # fmt: skip
    print_summary(results)
    return capsys.readouterr().out


def test_layers_left_as_they_were_are_not_counted_as_compressed(capsys):
    layers = [
        _layer("a", 32, rank=2),  # factorised
        _layer("b", 64),  # greedy allocation kept it dense
        _layer("c", 64),
        _layer("d", 32, sparsity=0.5),  # pruned: as many values stored, half of them zero
        _layer("e", 64, bits=8),  # int8: every weight kept, in 8 bits
    ]
    out = _print(capsys, layers)
    assert "3 layers compressed (2 of the 5 selected left as they were) in 1.0 s" in out


def test_every_layer_changed(capsys):
    out = _print(capsys, [_layer("a", 32, rank=2), _layer("b", 32, sparsity=0.5)])
    assert "2 layers compressed in 1.0 s" in out
