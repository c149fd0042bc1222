"""Stats hold tensors and JSON metadata only: save -> load -> apply gives what the fresh stats
give, for every one-shot pruner; what cannot be saved is refused with the key named."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, make_tiny_model

from lmcompress.compressor.method import Stats
from lmcompress.compressor.report import LayerReport
from lmcompress.errors import ConfigError
from lmcompress.methods import get_method
from lmcompress.methods.magnitude import MagnitudeConfig
from lmcompress.methods.sparsegpt import SparseGPTConfig
from lmcompress.methods.wanda import WandaConfig

CONFIGS = {
    "magnitude": MagnitudeConfig(sparsity="2:4"),
    "wanda": WandaConfig(sparsity="2:4", layer_sparsity=("*.mlp.*=0.5",)),
    "sparsegpt": SparseGPTConfig(sparsity="4:8", calib_batch_size=2),
}


def _calib() -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_save_load_apply_round_trip(name, tmp_path):
    config = CONFIGS[name]
    method = get_method(name)(config)
    model = make_tiny_model("llama")
    twin = make_tiny_model("llama")  # same seed: the same weights
    with torch.no_grad():
        stats = method.calibrate(model, _calib() if method.needs_calibration else None)
    path = tmp_path / "stats.safetensors"
    stats.save(path)
    loaded = Stats.load(path)
    assert loaded.meta.keys() == stats.meta.keys() and loaded.tensors.keys() == stats.tensors.keys()

    if method.needs_calibration:  # pruned in calibrate(): apply reports what was done
        fresh, again = method.apply(model, stats), method.apply(model, loaded)
    else:  # magnitude prunes in apply(): the loaded stats prune a twin the same way
        fresh, again = method.apply(model, stats), method.apply(twin, loaded)
        pairs = zip(model.parameters(), twin.parameters(), strict=True)
        assert all(torch.equal(a, b) for a, b in pairs)
    assert fresh.layers and all(isinstance(layer, LayerReport) for layer in again.layers)
    without_time = [{**layer.__dict__, "seconds": 0} for layer in again.layers]
    assert without_time == [{**layer.__dict__, "seconds": 0} for layer in fresh.layers]
    assert again.extra == fresh.extra and again.config == config.to_dict()
    patterns = {layer.pattern for layer in again.layers}
    assert patterns == ({"2:4", "0.5"} if name == "wanda" else {str(config.sparsity)})


@pytest.mark.parametrize("name", ["wanda", "sparsegpt"])
def test_layerwise_stats_refuse_a_model_that_was_not_pruned(name, tmp_path):
    method = get_method(name)(CONFIGS[name])
    with torch.no_grad():
        method.calibrate(make_tiny_model("llama"), _calib()).save(tmp_path / "s.safetensors")
    with pytest.raises(ConfigError, match="apply the stats to the calibrated model"):
        method.apply(make_tiny_model("llama"), Stats.load(tmp_path / "s.safetensors"))


def test_save_names_the_key_that_is_not_json(tmp_path):
    report = LayerReport("a", (4, 8), 32, 16, 128, 72)
    stats = Stats(tensors={"x": torch.ones(2)}, meta={"ok": [1, "two"], "layers": [report]})
    with pytest.raises(TypeError, match=r"Stats.meta\['layers'\] is not JSON-serialisable"):
        stats.save(tmp_path / "s.safetensors")
    assert not (tmp_path / "s.safetensors").exists()
    with pytest.raises(TypeError, match=r"non-tensors under \['y'\]"):
        Stats(tensors={"y": [1.0]}).save(tmp_path / "s.safetensors")


def test_tensors_and_meta_survive_exactly(tmp_path):
    tensors = {"h": torch.randn(3, 3, dtype=torch.float64), "m": torch.rand(4) > 0.5}
    meta = {"seconds": 0.1 + 0.2, "nested": {"a": [1, 2.5, None, "x"]}}
    Stats(tensors=tensors, meta=meta).save(tmp_path / "s.safetensors")
    loaded = Stats.load(tmp_path / "s.safetensors")
    assert loaded.meta == meta
    assert all(torch.equal(loaded.tensors[k], v) for k, v in tensors.items())
    assert loaded.tensors["h"].dtype == torch.float64
