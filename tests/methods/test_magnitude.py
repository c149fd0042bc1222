import pytest
import torch

from lmcompress import compress
from lmcompress.compressor.model.surgery import LayerSelection, weight_matrix
from lmcompress.errors import ConfigError
from lmcompress.methods.magnitude import MagnitudeConfig


def _inputs():
    return torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("sparsity", ["2:4", "4:8", "1:4"])
def test_nm_on_every_family(family_model, sparsity):
    model_type, model = family_model
    n, m = map(int, sparsity.split(":"))
    head_before = model.get_output_embeddings().weight.detach().clone()
    dense_logits = model(_inputs()).logits
    report = compress(model, MagnitudeConfig(sparsity=sparsity))
    layers = LayerSelection().select(model)
    assert [layer.name for layer in report.layers] == list(layers), model_type
    for name, module in layers.items():
        groups = (weight_matrix(module) != 0).reshape(-1, m)
        assert torch.all(groups.sum(1) <= n), name  # exactly N unless a kept weight was 0
        assert int(groups.sum()) >= groups.shape[0] * n - 2, name
    for layer in report.layers:
        assert layer.sparsity == pytest.approx(1 - n / m, abs=1e-3)
        assert layer.pattern == sparsity and 0 < layer.rel_error < 1
    assert torch.equal(model.get_output_embeddings().weight, head_before)  # head untouched
    assert not torch.allclose(model(_inputs()).logits, dense_logits)


def test_nm_keeps_the_largest_magnitudes():
    from conftest import make_tiny_model

    model = make_tiny_model("llama")
    name = "model.layers.0.mlp.down_proj"
    original = model.get_submodule(name).weight.detach().clone()
    compress(model, MagnitudeConfig(sparsity="2:4", include=(name,)))
    pruned = model.get_submodule(name).weight.detach()
    keep = original.abs().reshape(-1, 4).topk(2, dim=1).indices
    expected = torch.zeros_like(original).reshape(-1, 4)
    expected.scatter_(1, keep, original.reshape(-1, 4).gather(1, keep))
    assert torch.equal(pruned, expected.reshape(original.shape))


@pytest.mark.parametrize("ratio", [0.3, 0.5])
def test_unstructured_ratio_per_layer(ratio):
    from conftest import make_tiny_model

    model = make_tiny_model("qwen2")
    original = {
        n: weight_matrix(m).detach().clone() for n, m in LayerSelection().select(model).items()
    }
    report = compress(model, MagnitudeConfig(sparsity=str(ratio)))
    for layer in report.layers:
        assert layer.sparsity == pytest.approx(ratio, abs=1 / 256)  # int(numel * ratio) removed
        assert layer.pattern == f"{ratio:g}"
        keep = weight_matrix(model.get_submodule(layer.name)) != 0
        magnitudes = original[layer.name].abs()
        assert magnitudes[keep].min() >= magnitudes[~keep].max()  # dropped = smallest |W|
    assert report.summary()["params_kept"] < report.summary()["params_compressed_layers"]


def test_exclude_leaves_layers_identical():
    from conftest import make_tiny_model

    model = make_tiny_model("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = compress(model, MagnitudeConfig(sparsity="2:4", exclude=("*.mlp.*",)))
    assert report.layers and all(".mlp." not in layer.name for layer in report.layers)
    after = model.state_dict()
    for key, value in before.items():
        if ".mlp." in key or "lm_head" in key or "embed" in key or "norm" in key:
            assert torch.equal(after[key], value), key


def test_indivisible_layer_fails_before_touching_the_model():
    from conftest import make_odd_llama

    model = make_odd_llama(vocab_size=64)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError, match="in_features=36 is not divisible by M=8"):
        compress(model, MagnitudeConfig(sparsity="4:8"))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_report_counts_and_errors_agree_with_the_pruned_model():
    """Oracles from the tensors: the zeros 30 % unstructured pruning adds to the model (its
    linears have none before) are what the summary's parameters after lose, and each layer's
    relative error is ‖dropped weights‖ / ‖original‖."""
    from conftest import make_tiny_model

    def zeros(model):
        return sum(int((p == 0).sum()) for p in model.parameters())

    model = make_tiny_model("llama")
    original = {
        n: weight_matrix(m).detach().clone() for n, m in LayerSelection().select(model).items()
    }
    assert all(int((W == 0).sum()) == 0 for W in original.values())
    before = zeros(model)  # the embedding's padding row
    report = compress(model, MagnitudeConfig(sparsity="0.3"))
    summary = report.summary()
    assert summary["model_params"] == sum(p.numel() for p in model.parameters())
    assert summary["model_params"] - summary["model_params_after"] == zeros(model) - before
    for layer in report.layers:
        W = original[layer.name]
        dropped = W * (weight_matrix(model.get_submodule(layer.name)) == 0)
        assert layer.rel_error == pytest.approx(float(dropped.norm() / W.norm()), rel=1e-5)
