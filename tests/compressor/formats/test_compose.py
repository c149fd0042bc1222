"""Stages that compose: int8 codes of a 2:4-pruned layer stored packed (``nm_packed_int8``),
computing exactly what the uncomposed int8 layer computes; export then reload is exact."""

import pytest
import torch
from torch import nn

from lmcompress import compress
from lmcompress.compressor.formats.compose import compose_, layers_to_skip
from lmcompress.compressor.formats.int8 import QuantLinear
from lmcompress.compressor.formats.nm_packed_int8 import PackedNMInt8Linear
from lmcompress.compressor.io.load import load_compressed, read_manifest
from lmcompress.compressor.io.save import save_compressed
from lmcompress.methods.int8.config import Int8Config
from lmcompress.methods.magnitude.config import MagnitudeConfig
from lmcompress.methods.svd.config import SVDConfig
from tests.conftest import make_tiny_model


def _sparse_linear(out_features=24, in_features=40, bias=True):
    torch.manual_seed(0)
    linear = nn.Linear(in_features, out_features, bias=bias)
    W = linear.weight.data.view(out_features, -1, 4)  # (out, G, 4)
    drop = W.abs().topk(2, dim=-1, largest=False).indices
    W.scatter_(-1, drop, 0.0)
    return linear


@pytest.mark.parametrize("activations", ["dynamic", "static"])
@pytest.mark.parametrize("path", ["int", "simulated"])
def test_packed_int8_equals_int8(activations, path):
    linear = _sparse_linear()
    scale = torch.tensor(0.02) if activations == "static" else None
    quant = QuantLinear.from_linear(linear, activations=activations, input_scale=scale, path=path)
    packed = PackedNMInt8Linear.compose(quant, 2, 4)
    assert packed.activations == activations and packed.path == path
    assert torch.equal(packed.weight_codes(), quant.weight_q)
    x = torch.randn(3, 5, 40)
    assert torch.equal(packed(x), quant(x))
    assert torch.equal(packed.to_dense().weight, quant.to_dense().weight)
    # 2 codes of 8 bits + 2 positions of 2 bits per 4 weights: 20/32 of the int8 codes
    packed_bytes = packed.values.numel() + packed.indices.numel()
    assert packed_bytes / quant.weight_q.numel() == 0.625
    again = PackedNMInt8Linear.from_state(packed.state_tensors(), packed.meta())
    again.path = path  # a runtime choice, not stored (as for QuantLinear)
    assert torch.equal(again(x), packed(x))


@pytest.mark.parametrize("tokens", [1, 5, 12, 13, 40])  # the fused few-token kernel: <= 12
def test_packed_int8_with_grouped_scales_equals_int8(tokens):
    """Scales per group of 8 input channels: the packed layer computes the grouped int8
    layer's output at every token count. Oracle beside the bit-for-bit one: the W8A8 product
    written out, per-token activation codes times each group's dequantized weight codes."""
    linear = _sparse_linear(out_features=24, in_features=64)
    quant = QuantLinear.from_linear(linear, group_size=8)
    packed = PackedNMInt8Linear.compose(quant, 2, 4)
    assert packed.weight_scale.shape == (24, 8) and packed.group_size == 8
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(tokens))
    x_scale = x.abs().amax(1, keepdim=True) / 127  # (tokens, 1)
    x_deq = (x / x_scale).round().clamp(-128, 127) * x_scale
    W_deq = packed.weight_codes().float() * packed.weight_scale.repeat_interleave(8, dim=1)
    expected = x_deq @ W_deq.T + linear.bias
    torch.testing.assert_close(packed(x), expected, rtol=1e-4, atol=1e-5)
    assert torch.equal(packed(x), quant(x))


def test_packed_int8_load_refuses_an_impossible_pattern():
    """A file whose meta says 4:4 (every weight "kept"), its tensors consistent with that, is
    not an N:M layer: refused at load, naming the pattern."""
    from lmcompress.errors import ModelLoadError
    from lmcompress.kernels.reference import pack_nm

    packed = PackedNMInt8Linear.compose(QuantLinear.from_linear(_sparse_linear()), 2, 4)
    tensors, meta = packed.state_tensors(), packed.meta()
    values, indices = pack_nm(packed.weight_codes(), 4, 4)  # (24, 40): every position
    forged = {**tensors, "values": values, "indices": indices}
    with pytest.raises(ModelLoadError, match="invalid 4:4"):
        PackedNMInt8Linear.from_state(forged, {**meta, "n": 4, "m": 4})
    with pytest.raises(ModelLoadError, match="meta field n is 0, expected >= 1"):
        PackedNMInt8Linear.from_state(tensors, {**meta, "n": 0})


def test_dense_codes_do_not_pack():
    quant = QuantLinear.from_linear(nn.Linear(8, 4))
    with pytest.raises(Exception, match="not 2:4 sparse"):
        PackedNMInt8Linear.compose(quant, 2, 4)


def test_two_stages_export_reloads_exactly(tmp_path):
    model = make_tiny_model("llama")
    first = compress(model, MagnitudeConfig(sparsity="2:4"))
    assert layers_to_skip([first], {"nm_packed", None}) == []  # int8 composes with all of it
    second = compress(model, Int8Config())
    ids = torch.randint(0, 256, (2, 16))
    before = model(ids).logits
    report = compose_(model, [first, second])
    assert {layer.format for layer in report.layers} == {"nm_packed_int8"}
    assert report.method == "magnitude+int8" and len(report.layers) == len(first.layers)
    assert torch.equal(model(ids).logits, before)  # re-stored, not recomputed
    save_compressed(model, tmp_path / "out", report, dense_copy=False)
    layers = read_manifest(tmp_path / "out")["compressed_layers"]
    assert {entry["format"] for entry in layers.values()} == {"nm_packed_int8"}
    loaded, _, loaded_report = load_compressed(tmp_path / "out", runtime="packed")
    assert torch.equal(loaded(ids).logits, before)
    assert loaded_report.layers[0].sparsity == 0.5 and loaded_report.layers[0].bits == 8


def test_composed_report_counts_the_stored_codes_as_kept():
    """2:4 then int8: the int8 stage alone keeps every weight, the composition only the packed
    codes. Oracle: the kept count read off each stored module (``values`` holds one int8 code
    per kept weight), and the dense count off its unpacked codes' shape."""
    model = make_tiny_model("llama")
    report = compose_(
        model, [compress(model, MagnitudeConfig(sparsity="2:4")), compress(model, Int8Config())]
    )
    stored = {layer.name: model.get_submodule(layer.name) for layer in report.layers}
    kept = {name: module.values.numel() for name, module in stored.items()}
    for layer in report.layers:
        assert layer.params == stored[layer.name].weight_codes().numel() == 2 * kept[layer.name]
        assert layer.params_kept == kept[layer.name], (
            f"{layer.name}: report keeps {layer.params_kept} of {layer.params}, "
            f"{kept[layer.name]} codes stored"
        )
    summary = report.summary()
    assert summary["params_kept"] == sum(kept.values())
    pruned = summary["params_compressed_layers"] - sum(kept.values())
    assert summary["model_params"] - summary["model_params_after"] == pruned


def test_a_layer_two_stages_changed_is_left_to_them():
    """After 2:4 then int8, a third stage that composes after N:M must not touch the composed
    layers: two stages changed each (at most two compose), whatever the first one's format."""
    model = make_tiny_model("llama")
    first = compress(model, MagnitudeConfig(sparsity="2:4"))
    second = compress(model, Int8Config())
    names = {layer.name for layer in first.layers}
    assert layers_to_skip([first], {"nm_packed", None}) == []
    assert set(layers_to_skip([first, second], {"nm_packed", None})) == names


def test_low_rank_layers_are_left_to_their_stage():
    model = make_tiny_model("llama")
    first = compress(model, SVDConfig(ratio=0.6, include=("*.mlp.*",)))
    factorised = {layer.name for layer in first.layers if layer.format == "low_rank"}
    assert factorised
    assert set(layers_to_skip([first], {"nm_packed", None})) == factorised  # even for int8
    second = compress(model, MagnitudeConfig(sparsity="2:4"))  # sees only the plain linears
    assert not factorised & {layer.name for layer in second.layers}
    report = compose_(model, [first, second])
    formats = {layer.name: layer.format for layer in report.layers}
    assert {formats[name] for name in factorised} == {"low_rank"}
    assert set(formats.values()) == {"low_rank", "nm_packed"}
