"""QuantLinear (the int8 format), its quantization primitives and torch.ops.lmcompress.int8_linear:
bit-exact quantization against exact arithmetic, exact int32 accumulation, the integer path
against the simulated path, round trips, torch.compile, opcheck, bad options."""

import json
from fractions import Fraction

import pytest
import torch
from conftest import FAMILY_NAMES, make_tiny_model, make_tiny_tokenizer
from torch import nn
from transformers.pytorch_utils import Conv1D

from lmcompress import load_compressed, save_compressed
from lmcompress.compressor.formats import quant
from lmcompress.compressor.formats.catalog import format_class
from lmcompress.compressor.formats.int8 import QuantLinear
from lmcompress.compressor.model.surgery import LayerSelection, replace_modules, weight_matrix
from lmcompress.compressor.report import CompressionReport
from lmcompress.errors import ConfigError, ModelLoadError
from lmcompress.kernels.int8_ops import int8_linear, int8_matmul


def _exact_codes(x: torch.Tensor, scale: float) -> list[int]:
    """The integer reference: round-half-to-even of the exact rational x / scale, clamped."""
    return [max(-128, min(127, round(Fraction(v) / Fraction(scale)))) for v in x.tolist()]


@pytest.mark.parametrize("scale", [2.0**-3, 2.0**-7, 0.5, 4.0])
def test_quantize_dequantize_equal_the_exact_integer_reference(scale):
    """With a power-of-two scale ``x / s`` is exact, so the codes must equal the rational
    reference bit for bit, ties included (half to even), and ``q · s`` must equal ``Fraction``."""
    torch.manual_seed(0)
    k = torch.arange(-140, 140, dtype=torch.float32)
    ties = (k + 0.5) * scale  # every value exactly halfway between two codes
    x = torch.cat([ties, torch.randn(2000) * 60 * scale])
    q = quant.quantize(x, torch.tensor([scale]))
    assert q.dtype == torch.int8
    assert q.tolist() == _exact_codes(x, scale)
    assert quant.quantize(torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5]), 1.0).tolist() == [
        0,
        2,
        2,
        0,
        -2,
    ]
    back = quant.dequantize(q, torch.tensor([scale]))
    assert back.tolist() == [float(Fraction(int(c)) * Fraction(scale)) for c in q.tolist()]


def test_every_code_survives_dequantize_then_quantize_for_any_scale():
    torch.manual_seed(1)
    q = torch.arange(-128, 128, dtype=torch.int8).repeat(300, 1)  # (300, 256)
    scale = torch.rand(300, 1) * 10 + 1e-6  # arbitrary float32 scales
    assert torch.equal(quant.quantize(quant.dequantize(q, scale), scale), q)
    # dequantize is the correctly rounded product: q · s exact in float64, then one rounding
    assert torch.equal(quant.dequantize(q, scale), (q.double() * scale.double()).float())


@pytest.mark.parametrize("group_size", [None, 8, 32])
def test_int8_weight_matches_a_per_row_reference(group_size):
    torch.manual_seed(2)
    W = torch.randn(6, 64)
    W[3] = 0.0  # a zero row: scale 1, codes 0
    q, scale = quant.int8_weight(W, group_size)
    gs = group_size or 64
    assert scale.shape == (6, 64 // gs) and scale.dtype == torch.float32
    for row in range(6):
        for g in range(64 // gs):
            block = W[row, g * gs : (g + 1) * gs]
            want = block.abs().max() / 127 if block.abs().max() > 0 else torch.tensor(1.0)
            assert scale[row, g] == want
            assert torch.equal(
                q[row, g * gs : (g + 1) * gs], torch.round(block / want).to(torch.int8)
            )
    assert q.abs().max() == 127 and torch.equal(q[3], torch.zeros(64, dtype=torch.int8))


def test_per_token_scale_is_absmax_over_127_with_a_floor():
    x = torch.tensor([[1.0, -254.0, 3.0], [0.0, 0.0, 0.0]])
    assert torch.equal(quant.per_token_scale(x), torch.tensor([[2.0], [quant.MIN_SCALE]]))
    assert quant.quantize(x, quant.per_token_scale(x)).tolist() == [[0, -127, 2], [0, 0, 0]]


@pytest.mark.parametrize(("tokens", "in_f", "out_f"), [(1, 5, 3), (17, 13, 11), (64, 4096, 8)])
@pytest.mark.parametrize("pad", [False, True])
def test_int32_accumulator_is_bit_exact(tokens, in_f, out_f, pad):
    torch.manual_seed(3)
    x_q = torch.randint(-128, 128, (tokens, in_f), dtype=torch.int8)
    w_q = torch.randint(-128, 128, (out_f, in_f), dtype=torch.int8)
    x_q[0], w_q[0] = -128, -128  # the extreme product, summed in_f times
    acc = int8_matmul(x_q, w_q, pad=pad)
    assert acc.dtype == torch.int32 and acc.shape == (tokens, out_f)
    assert torch.equal(acc.long(), x_q.long() @ w_q.long().T)
    assert acc[0, 0] == 128 * 128 * in_f


def _layer(kind="linear", bias=True, in_f=64, out_f=40, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(in_f, out_f, bias=bias) if kind == "linear" else Conv1D(out_f, in_f)


@pytest.mark.parametrize("activations", ["dynamic", "static"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 64), (3, 7, 64), (2, 300, 64), (48, 4096)])
def test_integer_path_equals_simulated_path(activations, bias, shape):
    layer = _layer(bias=bias, in_f=shape[-1])
    torch.manual_seed(4)
    x = torch.randn(shape) * 3
    x[..., 5] *= 20  # an outlier channel: static clipping and large accumulators
    input_scale = quant.absmax_scale(x.abs().max() * 0.5) if activations == "static" else None
    module = QuantLinear.from_linear(layer, activations, input_scale)
    assert module.activations == activations and module.path == "int"
    with torch.no_grad():
        y_int = module(x)
        module.path = "simulated"
        y_sim = module(x)
        y_ref = layer(x)
    assert y_int.shape == y_sim.shape == (*shape[:-1], 40) and y_int.dtype == torch.float32
    # The int32 sum is exact and the float64 simulation nearly so: what is left is the float32
    # rounding of the rescale (three roundings, int path) against one (simulated), <= 2 eps
    # relative per element. A float32 simulated matmul would round every partial sum and fail.
    eps = torch.finfo(torch.float32).eps
    terms = y_sim - module.bias if bias else y_sim  # the bias add may cancel: its own rounding
    bound = 2 * eps * terms.abs() + (eps * y_sim.abs() if bias else 0)
    diff = (y_int - y_sim).abs()
    assert (diff <= bound + 1e-12 * y_sim.abs().max()).all(), (diff - bound).max()
    if activations == "dynamic":  # static clips the outlier on purpose
        cos = torch.nn.functional.cosine_similarity(y_int.flatten(), y_ref.flatten(), dim=0)
        assert cos > 0.995  # the outlier channel costs the other channels resolution


def test_grouped_integer_path_equals_simulated_to_float32_rounding():
    layer = _layer(in_f=96)
    module = QuantLinear.from_linear(layer, group_size=32)
    assert module.weight_scale.shape == (40, 3) and module.group_size == 32
    x = torch.randn(5, 96)
    with torch.no_grad():
        y_int = module(x)
        module.path = "simulated"
        y_sim = module(x)
    torch.testing.assert_close(y_int, y_sim, rtol=1e-5, atol=1e-5 * y_sim.abs().max().item())


def test_output_dtype_follows_the_input_and_scales_stay_float32():
    module = QuantLinear.from_linear(_layer().to(torch.bfloat16))
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    assert module(x).dtype == torch.bfloat16 and module.dense_weight().dtype == torch.bfloat16
    static = QuantLinear.from_linear(_layer(), "static", 0.0123)
    scales = static.weight_scale.clone()
    static.to(torch.bfloat16)
    assert static.weight_scale.dtype == static.input_scale.dtype == torch.float32
    assert torch.equal(static.weight_scale, scales)
    assert torch.equal(static.input_scale, torch.tensor([0.0123]))
    assert static.weight_q.dtype == torch.int8 and static.bias.dtype == torch.bfloat16


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
@pytest.mark.parametrize(
    ("activations", "group_size", "bias"),
    [("dynamic", None, True), ("static", None, True), ("dynamic", 16, False), ("static", 32, True)],
)
def test_from_state_round_trips_exactly(kind, activations, group_size, bias):
    layer = _layer(kind, bias=bias or kind == "conv1d")
    scale = 0.05 if activations == "static" else None
    module = format_class("int8").from_linear(layer, activations, scale, group_size)
    assert isinstance(module, QuantLinear) and module.conv1d == (kind == "conv1d")
    meta = json.loads(json.dumps(module.meta()))
    assert meta["activations"] == activations and meta["group_size"] == group_size
    rebuilt = QuantLinear.from_state(module.state_tensors(), meta)
    assert rebuilt.state_tensors().keys() == module.state_tensors().keys()
    for key, value in module.state_tensors().items():
        assert torch.equal(rebuilt.state_tensors()[key], value), key
    x = torch.randn(3, 64)
    assert torch.equal(rebuilt(x), module(x))
    dense = rebuilt.to_dense()
    assert type(dense) is type(layer)
    W = quant.dequantize(module.weight_q, module.weight_scale)
    assert torch.equal(weight_matrix(dense), W)
    torch.testing.assert_close(weight_matrix(dense), weight_matrix(layer), rtol=0, atol=0.01)


def test_torch_compile_traces_the_op_in_one_graph():
    module = QuantLinear.from_linear(_layer())
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 9, 64)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), module(x), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(compiled(x[:, :4]), module(x[:, :4]), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("groups", "static", "bias"), [(1, False, True), (1, True, False), (4, False, True)]
)
def test_opcheck(groups, static, bias):
    torch.manual_seed(5)
    x_q = torch.randint(-128, 128, (7, 32), dtype=torch.int8)
    w_q = torch.randint(-128, 128, (12, 32), dtype=torch.int8)
    x_scale = torch.rand(1) + 0.1 if static else torch.rand(7, 1) + 0.1
    w_scale = torch.rand(12, groups) + 0.1
    b = torch.randn(12) if bias else None
    for dtype in (torch.float32, torch.bfloat16):
        torch.library.opcheck(int8_linear, (x_q, x_scale, w_q, w_scale, b, dtype))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"bits": 4}, "bits must be 8"),
        ({"activations": "per-channel"}, "unknown activation"),
        ({"group_size": 7}, "does not divide"),
        ({"group_size": 0}, "positive integer"),
        ({"activations": "static"}, "need an input_scale"),
        ({"activations": "static", "input_scale": 0.0}, "input_scale must be finite and > 0"),
        ({"activations": "static", "input_scale": float("nan")}, "finite and > 0"),
        ({"activations": "static", "input_scale": torch.ones(2)}, "per tensor"),
        ({"input_scale": 0.1}, "for static activations"),
        ({"path": "fast"}, "unknown int8 path"),
    ],
)
def test_bad_options_are_one_line_config_errors(options, message):
    with pytest.raises(ConfigError, match=message) as info:
        QuantLinear.from_linear(_layer(), **options)
    assert "\n" not in str(info.value)


def test_bad_primitive_arguments_and_bad_state():
    with pytest.raises(ConfigError, match="must be finite and > 0, got 0"):
        quant.quantize(torch.ones(3), 0.0)
    with pytest.raises(ConfigError, match="does not divide"):
        quant.int8_weight(torch.ones(4, 10), group_size=4)
    module = QuantLinear.from_linear(_layer(), "static", 0.1)
    tensors, meta = dict(module.state_tensors()), module.meta()
    for key, bad, message in [
        ("weight_scale", torch.zeros(40, 1), "finite and > 0"),
        ("weight_scale", torch.ones(40, 2), "shape"),
        ("weight_q", module.weight_q.float(), "expected int8"),
        ("input_scale", None, "input_scale"),
    ]:
        broken = (
            {**tensors, key: bad}
            if bad is not None
            else {k: v for k, v in tensors.items() if k != key}
        )
        with pytest.raises(ModelLoadError, match=message):
            QuantLinear.from_state(broken, meta)
    with pytest.raises(ModelLoadError, match="meta field bits is 4"):
        QuantLinear.from_state(tensors, {**meta, "bits": 4})


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_every_family_exports_and_reloads_the_int8_runtime(tmp_path, family):
    model = make_tiny_model(family)
    names = list(LayerSelection().select(model))
    replace_modules(model, names, lambda _, layer: QuantLinear.from_linear(layer))
    report = CompressionReport(method="test", config={})
    out = save_compressed(model, tmp_path / "out", report, tokenizer=make_tiny_tokenizer())
    packed, _, _ = load_compressed(out, runtime="packed")
    assert all(isinstance(packed.get_submodule(name), QuantLinear) for name in names)
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        assert torch.equal(packed(ids).logits, model(ids).logits)
