"""Wanda and SparseGPT through the layer-wise loop, and what all pruners share."""

import pytest
import torch

from lmcompress import MagnitudeConfig, SparseGPTConfig, WandaConfig, compress
from lmcompress.compressor.model.surgery import LayerSelection, weight_matrix
from lmcompress.errors import ConfigError

CONFIGS = {"magnitude": MagnitudeConfig, "wanda": WandaConfig, "sparsegpt": SparseGPTConfig}


def _data(seed=0):
    return torch.randint(3, 256, (8, 32), generator=torch.Generator().manual_seed(seed))


def _weights(model):
    return {n: weight_matrix(m).detach().clone() for n, m in LayerSelection().select(model).items()}


@pytest.mark.parametrize("method", sorted(CONFIGS))
@pytest.mark.parametrize("sparsity", ["2:4", "4:8"])
def test_nm_invariant_for_every_method(method, sparsity):
    from conftest import make_tiny_model

    n, m = map(int, sparsity.split(":"))
    model = make_tiny_model("llama")
    report = compress(model, CONFIGS[method](sparsity=sparsity), _data())
    assert report.method == method and len(report.layers) == 14
    for name, W in _weights(model).items():
        per_group = (W != 0).reshape(-1, m).sum(1)
        assert torch.all(per_group == n), (method, name)  # random weights: no kept weight is 0


@pytest.mark.parametrize("method", ["wanda", "sparsegpt"])
def test_unstructured_rate_and_determinism(method):
    from conftest import make_tiny_model

    runs = []
    for _ in range(2):
        model = make_tiny_model("gpt2")
        report = compress(model, CONFIGS[method](sparsity="0.5"), _data())
        runs.append(_weights(model))
        for layer in report.layers:
            assert layer.sparsity == pytest.approx(0.5, abs=0.01), layer.name
        # Wanda ranks within each output row (Eq. 1); SparseGPT within a block of columns
        for name, W in runs[-1].items() if method == "wanda" else ():
            kept = (W != 0).sum(1)
            assert torch.all(kept == W.shape[1] // 2), f"{name} rows keep {kept.unique().tolist()}"
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])  # same seed, same result
    model = make_tiny_model("gpt2")
    compress(model, CONFIGS[method](sparsity="0.5"), _data(seed=1))
    assert any(not torch.equal(runs[0][k], v) for k, v in _weights(model).items())


def test_wanda_mask_is_magnitude_times_input_norm():
    from conftest import make_tiny_model

    from lmcompress.compressor.sparsity import nm_mask

    model = make_tiny_model("llama")
    name = "model.layers.0.self_attn.q_proj"
    original = model.get_submodule(name).weight.detach().clone()
    inputs = []
    handle = model.get_submodule(name).register_forward_pre_hook(lambda _m, a: inputs.append(a[0]))
    with torch.no_grad():
        model(input_ids=_data(), use_cache=False)
    handle.remove()
    X = torch.cat(inputs).reshape(-1, original.shape[1])
    expected = original * nm_mask(original.abs() * X.norm(dim=0), 2, 4)
    compress(model, WandaConfig(sparsity="2:4", include=(name,)), _data())
    torch.testing.assert_close(model.get_submodule(name).weight, expected)


def test_sparsegpt_beats_wanda_and_magnitude_on_output_error():
    """On the calibration inputs, SparseGPT's reconstruction keeps layer outputs closest."""
    from conftest import make_tiny_model

    from lmcompress.compressor.calibration.observers import HessianAccumulator
    from lmcompress.methods.sparsegpt.method import output_error

    errors = {}
    for method in CONFIGS:
        model = make_tiny_model("llama")
        before = _weights(model)
        hessians = {}
        handles = []
        for name, module in LayerSelection().select(model).items():
            hessians[name] = HessianAccumulator(weight_matrix(module).shape[1])
            handles.append(
                module.register_forward_pre_hook(
                    lambda _m, a, _h=hessians[name]: _h.add_batch(a[0])
                )
            )
        with torch.no_grad():
            model(input_ids=_data(), use_cache=False)  # dense inputs of every layer
        for handle in handles:
            handle.remove()
        compress(model, CONFIGS[method](sparsity="2:4"), _data())
        after = _weights(model)
        errors[method] = sum(output_error(before[n], after[n], hessians[n].H) for n in before)
    assert errors["sparsegpt"] < errors["wanda"] and errors["sparsegpt"] < errors["magnitude"]


def test_sparsegpt_without_update_keeps_original_values():
    from conftest import make_tiny_model

    model = make_tiny_model("llama")
    before = _weights(model)
    compress(model, SparseGPTConfig(sparsity="2:4", update_weights=False), _data())
    for name, W in _weights(model).items():
        keep = W != 0
        assert torch.equal(W[keep], before[name][keep])


def test_layer_sparsity_overrides_and_validation():
    from conftest import make_tiny_model

    model = make_tiny_model("llama")
    config = WandaConfig(sparsity="2:4", layer_sparsity=("*.mlp.*=0.25", "*.q_proj=1:4"))
    report = compress(model, config, _data())
    patterns = {layer.name.rsplit(".", 1)[-1]: layer.pattern for layer in report.layers}
    assert patterns["down_proj"] == "0.25" and patterns["q_proj"] == "1:4"
    assert patterns["k_proj"] == "2:4"
    with pytest.raises(ConfigError, match="GLOB=SPARSITY"):
        WandaConfig(layer_sparsity=("nonsense",))
    with pytest.raises(ConfigError, match="impossible"):
        WandaConfig(layer_sparsity=("*=3:2",))
    with pytest.raises(ConfigError, match="needs calibration data"):
        compress(make_tiny_model("llama"), WandaConfig())
    with pytest.raises(ConfigError, match="percdamp"):
        SparseGPTConfig(percdamp=-1)


@pytest.mark.parametrize("method", ["wanda", "sparsegpt"])
def test_apply_prunes_from_synthetic_statistics(method):
    """``apply`` holds the computation: given a layer's statistic (no calibration at all), it
    prunes that layer exactly as the pure math says, and leaves every other layer alone."""
    from conftest import make_tiny_model

    from lmcompress.compressor.config import parse_sparsity
    from lmcompress.compressor.method import Stats
    from lmcompress.methods import get_method
    from lmcompress.methods.sparsegpt.solver import sparsegpt_prune
    from lmcompress.methods.wanda.scores import wanda_mask

    model = make_tiny_model("llama")
    before = _weights(model)
    name = "model.layers.1.mlp.up_proj"
    W = before[name]  # (64, 32)
    generator = torch.Generator().manual_seed(1)
    X = torch.randn(100, W.shape[1], generator=generator)  # stand-in calibration inputs
    sparsity = parse_sparsity("2:4")
    if method == "sparsegpt":
        statistic = 2 / 100 * X.T @ X  # (in, in)
        expected, _ = sparsegpt_prune(W, statistic, sparsity)
    else:
        statistic = X.square().sum(0).sqrt()  # (in,)
        expected = W * wanda_mask(W, statistic, sparsity)
    method_class = get_method(method)
    tensors = {f"{name}.{method_class.statistic}": statistic}
    report = method_class(CONFIGS[method](sparsity="2:4")).apply(model, Stats(tensors=tensors))
    after = _weights(model)
    assert [layer.name for layer in report.layers] == [name]
    assert torch.equal(after[name], expected.to(W.dtype))
    assert all(torch.equal(after[n], before[n]) for n in before if n != name)


@pytest.mark.parametrize("method", sorted(CONFIGS))
def test_a_sparsity_that_removes_no_weight_is_refused(method):
    """1e-300 rounds down to no weight in every layer: refused (as the low-rank methods refuse
    a ratio that leaves every layer dense), naming the least that removes one; that least
    does remove a weight, counted the way this method rounds (whole layer, per row, per
    block of columns)."""
    from conftest import make_tiny_model

    model = make_tiny_model("llama")
    extra = {"blocksize": 8} if method == "sparsegpt" else {}  # blocks narrower than a layer
    with pytest.raises(ConfigError, match="removes no weight of any selected layer") as caught:
        compress(model, CONFIGS[method](sparsity=1e-300, **extra), _data())
    largest = int(str(caught.value).split("at least 1/")[1].split(" ")[0])
    before = _weights(model)
    report = compress(model, CONFIGS[method](sparsity=1.0001 / largest, **extra), _data())
    removed = sum(int((W != 0).sum() - (_weights(model)[n] != 0).sum()) for n, W in before.items())
    assert removed >= 1 and any(layer.sparsity > 0 for layer in report.layers)
    with pytest.raises(ConfigError, match="removes no weight"):
        tiny = make_tiny_model("llama")
        compress(tiny, CONFIGS[method](sparsity=0.9999 / largest, **extra), _data())
