"""The ``int4`` and ``nm_packed_int4`` formats: the packed layout round trips, the grid, the
modules' computation, export then reload by replay, and tampered tensors refused at load."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import FAMILY_NAMES, make_tiny_model, make_tiny_tokenizer
from safetensors.torch import load_file, save_file
from torch import nn
from transformers.pytorch_utils import Conv1D

from lmcompress import load_compressed, save_compressed
from lmcompress.compressor.formats import grid
from lmcompress.compressor.formats.catalog import format_class
from lmcompress.compressor.formats.int4 import Int4Linear, PackedNMInt4Linear
from lmcompress.compressor.io.layout import COMPRESSED_TENSORS
from lmcompress.compressor.model.surgery import LayerSelection, replace_modules, weight_matrix
from lmcompress.compressor.report import CompressionReport
from lmcompress.errors import ConfigError, ModelLoadError
from lmcompress.kernels.int4_reference import dequantize, pack_codes, unpack_codes


@pytest.mark.parametrize("bits", [3, 4, 8])
@pytest.mark.parametrize("in_features", [1, 7, 32, 33])
def test_pack_then_unpack_is_the_identity(bits, in_features):
    torch.manual_seed(bits)
    q = torch.randint(0, 1 << bits, (5, in_features), dtype=torch.uint8)
    packed = pack_codes(q, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (5, in_features if bits == 8 else (in_features + 1) // 2)
    assert torch.equal(unpack_codes(packed, bits, in_features), q)
    if bits <= 4:  # low nibble = even column, high = odd; an odd last column: high 0
        assert torch.equal(packed[:, 0] & 0x0F, q[:, 0])
        if in_features % 2:
            assert not (packed[:, -1] >> 4).any()
        else:
            assert torch.equal(packed[:, 0] >> 4, q[:, 1])


def test_dequantize_is_codes_minus_zero_times_scale_per_group():
    q = torch.tensor([[0, 15, 8, 9], [1, 2, 3, 4]], dtype=torch.uint8)
    scales = torch.tensor([[0.5, 2.0], [1.0, 0.25]])
    zeros = torch.tensor([[8, 8], [0, 3]], dtype=torch.uint8)
    W = dequantize(pack_codes(q, 4), scales, zeros, 4, 2, 4)
    assert W.tolist() == [[-4.0, 3.5, 0.0, 2.0], [1.0, 2.0, 0.0, 0.25]]
    per_row = dequantize(pack_codes(q, 4), scales[:, :1], zeros[:, :1], 4, -1, 4)
    assert per_row.tolist() == [[-4.0, 3.5, 0.0, 0.5], [1.0, 2.0, 3.0, 4.0]]


@pytest.mark.parametrize("bits", [3, 4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group_size", [-1, 8])
def test_rtn_layer_lies_on_its_grid_and_computes_with_it(bits, symmetric, group_size):
    torch.manual_seed(0)
    linear = nn.Linear(32, 6, bias=True)
    layer = Int4Linear.from_linear(linear, bits=bits, group_size=group_size, symmetric=symmetric)
    q = layer.weight_codes()
    assert int(q.max()) <= (1 << bits) - 1
    assert layer.scales.shape == (6, 1 if group_size == -1 else 32 // group_size)
    if symmetric:
        assert (layer.zeros == 1 << (bits - 1)).all()
    W = layer.dense_weight()
    # round to nearest: no grid point of the group is closer than the chosen one (1 step)
    steps = grid.expand(layer.scales, 32)
    assert ((W - linear.weight).abs() <= steps / 2 * (1 + 1e-5) + 1e-7).float().mean() > 0.95
    assert ((W - linear.weight).abs() <= steps * (1 + 1e-5)).all()
    x = torch.randn(3, 7, 32)  # 21 tokens: past the decode kernels, the dequantized matmul
    assert torch.equal(layer(x), nn.functional.linear(x, W, linear.bias))
    # a finer grid is closer to the weight
    if bits < 8:
        finer = Int4Linear.from_linear(linear, bits=8, group_size=group_size, symmetric=symmetric)
        assert (finer.dense_weight() - linear.weight).norm() < (W - linear.weight).norm()


def test_layer_round_trips_through_its_state_and_keeps_float32_scales():
    torch.manual_seed(0)
    layer = Int4Linear.from_linear(nn.Linear(16, 4), bits=4, group_size=8, symmetric=False)
    again = format_class("int4").from_state(layer.state_tensors(), layer.meta())
    assert all(
        torch.equal(a, b)
        for a, b in zip(again.state_tensors().values(), layer.state_tensors().values(), strict=True)
    )
    assert again.meta() == layer.meta()
    half = again.to(torch.bfloat16)
    assert half.scales.dtype == torch.float32 and half.bias.dtype == torch.bfloat16
    assert torch.equal(layer.expanded().weight, layer.dense_weight())


def _sparse_linear(n=2, m=4, in_features=32, out_features=6):
    torch.manual_seed(1)
    linear = nn.Linear(in_features, out_features)
    groups = linear.weight.detach().view(out_features, -1, m)
    keep = torch.zeros_like(groups, dtype=torch.bool).scatter_(
        -1, groups.abs().topk(n, -1).indices, True
    )
    linear.weight.data = (groups * keep).view(out_features, in_features)
    return linear


@pytest.mark.parametrize("bits", [3, 4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
def test_nm_packed_int4_equals_the_int4_layer_it_packs(bits, symmetric):
    linear = _sparse_linear()
    dense = Int4Linear.from_linear(linear, bits=bits, group_size=8, symmetric=symmetric)
    packed = PackedNMInt4Linear.from_linear(
        linear, n=2, m=4, bits=bits, group_size=8, symmetric=symmetric
    )
    assert packed.qweight.shape == (6, 16 if bits == 8 else 8)
    assert torch.equal(packed.weight_codes(), dense.weight_codes())
    assert torch.equal(packed.dense_weight(), dense.dense_weight())
    assert (packed.dense_weight()[linear.weight == 0] == 0).all()  # pruned: exactly 0
    x = torch.randn(4, 32)
    assert torch.equal(packed(x), dense(x))
    again = format_class("nm_packed_int4").from_state(packed.state_tensors(), packed.meta())
    assert torch.equal(again.dense_weight(), packed.dense_weight())


def test_packing_a_weight_that_is_not_nm_sparse_is_refused():
    with pytest.raises(ConfigError, match="not 2:4 sparse"):
        PackedNMInt4Linear.from_linear(nn.Linear(8, 2), n=2, m=4, group_size=-1)


@pytest.mark.parametrize("family", FAMILY_NAMES)
@pytest.mark.parametrize("fmt", ["int4", "nm_packed_int4"])
def test_export_then_reload_by_replay_computes_the_same(tmp_path, family, fmt):
    model = make_tiny_model(family)
    names = list(LayerSelection().select(model))

    def compress(_name, layer):
        if fmt == "int4":
            return Int4Linear.from_linear(layer, bits=4, group_size=16, symmetric=False)
        return PackedNMInt4Linear.from_linear(
            _prune_2_4(layer), n=2, m=4, bits=4, group_size=16, symmetric=True
        )

    replace_modules(model, names, compress)
    report = CompressionReport(method="test", config={})
    out = save_compressed(model, tmp_path / "out", report, tokenizer=make_tiny_tokenizer())
    packed, _, _ = load_compressed(out, runtime="packed")
    dense, _, _ = load_compressed(out, runtime="dense")
    assert all(type(packed.get_submodule(name)).format == fmt for name in names)
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        expected = model(ids).logits
        assert torch.equal(packed(ids).logits, expected)
        assert torch.allclose(dense(ids).logits, expected, atol=1e-5)


def _prune_2_4(layer: nn.Module) -> nn.Module:
    """``layer`` with its two smallest weights of every 4 inputs zeroed (in place)."""
    W = weight_matrix(layer).detach()
    groups = W.reshape(W.shape[0], -1, 4)
    keep = torch.zeros_like(groups, dtype=torch.bool).scatter_(
        -1, groups.abs().topk(2, -1).indices, True
    )
    pruned = (groups * keep).reshape(W.shape)
    layer.weight.data.copy_(pruned.T if isinstance(layer, Conv1D) else pruned)
    return layer


def _state(fmt):
    if fmt == "int4":
        return Int4Linear.from_linear(nn.Linear(16, 4), bits=3, group_size=8, symmetric=True)
    return PackedNMInt4Linear.from_linear(
        _sparse_linear(in_features=16, out_features=4),
        n=2,
        m=4,
        bits=3,
        group_size=8,
        symmetric=True,
    )


def _set(key, value_fn):
    def edit(tensors, _meta):
        tensors[key] = value_fn(tensors[key].clone())

    return edit


def _meta(key, value):
    def edit(_tensors, meta):
        meta[key] = value

    return edit


def _nan_scale(t):
    t[0, 0] = float("nan")
    return t


def _code_8(t):
    t[0, 0] = 0x08  # low nibble 8: out of range for 3 bits
    return t


def _zero(t):
    t[1, 0] = 3
    return t


TAMPERED = {
    "code above 7 at 3 bits": (_set("qweight", _code_8), "above 7"),
    "zero not symmetric": (_set("zeros", _zero), "symmetric, but a zero point is not 4"),
    "zero out of range": (_set("zeros", lambda t: t.fill_(9)), "above 7"),
    "nan scale": (_set("scales", _nan_scale), "finite and > 0"),
    "zero scale": (_set("scales", lambda t: t.fill_(0)), "finite and > 0"),
    "wrong shape": (_set("scales", lambda t: t[:, :1].contiguous()), "scales has shape"),
    "wrong dtype": (_set("zeros", lambda t: t.to(torch.int8)), "zeros is int8"),
    "bad bits": (_meta("bits", 5), "bits is 5"),
    "group not dividing": (_meta("group_size", 5), "does not divide"),
}


@pytest.mark.parametrize("fmt", ["int4", "nm_packed_int4"])
@pytest.mark.parametrize("case", sorted(TAMPERED))
def test_tampered_state_is_refused_in_one_line(fmt, case):
    layer = _state(fmt)
    tensors, meta = dict(layer.state_tensors()), dict(layer.meta())
    edit, message = TAMPERED[case]
    edit(tensors, meta)
    with pytest.raises(ModelLoadError, match=message) as info:
        format_class(fmt).from_state(tensors, meta)
    assert "\n" not in str(info.value)


def test_odd_rows_unused_nibble_must_be_zero():
    layer = Int4Linear.from_linear(nn.Linear(7, 3), bits=4, group_size=-1)
    tensors = dict(layer.state_tensors())
    tensors["qweight"] = tensors["qweight"].clone()
    tensors["qweight"][0, -1] |= 0x10
    with pytest.raises(ModelLoadError, match="high nibble"):
        Int4Linear.from_state(tensors, layer.meta())


def test_a_tampered_export_is_refused_at_load(tmp_path):
    model = make_tiny_model("llama")
    names = list(LayerSelection().select(model))
    replace_modules(
        model, names, lambda _, layer: Int4Linear.from_linear(layer, bits=3, group_size=16)
    )
    out = save_compressed(model, tmp_path / "out", CompressionReport(method="test", config={}))
    tensors = load_file(out / COMPRESSED_TENSORS)
    key = f"{names[0]}.zeros"
    tensors[key] = tensors[key].clone().fill_(2)
    save_file(tensors, out / COMPRESSED_TENSORS, metadata={"format": "pt"})
    for runtime in ("packed", "dense"):
        with pytest.raises(
            ModelLoadError, match=f"compressed layer {names[0]}: int4 layer: symmetric"
        ):
            load_compressed(out, runtime=runtime)


@pytest.mark.parametrize("fmt", ["int4", "nm_packed_int4"])
@torch.no_grad()
def test_from_pretrained_builds_the_runtime_of_a_compact_bf16_export(tmp_path, fmt):
    """transformers' loader (through lmcompress's quantizer) builds the same modules as
    ``load_compressed``; the scales stay float32 in a bfloat16 model."""
    model = make_tiny_model("llama")
    names = list(LayerSelection().select(model))
    if fmt == "int4":
        replace_modules(model, names, lambda _, layer: Int4Linear.from_linear(layer, group_size=16))
    else:
        replace_modules(
            model,
            names,
            lambda _, layer: PackedNMInt4Linear.from_linear(_prune_2_4(layer), 2, 4, group_size=16),
        )
    report = CompressionReport(method="test", config={})
    out = save_compressed(model, tmp_path / "out", report, dtype=torch.bfloat16, dense_copy=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    ref, _, _ = load_compressed(out, runtime="packed")
    layer = hf.get_submodule(names[0])
    assert type(layer).format == fmt and layer.scales.dtype == torch.float32
    assert hf.dtype == torch.bfloat16
    ids = torch.randint(0, 256, (2, 12))
    assert torch.equal(hf(ids).logits, ref(ids).logits)
