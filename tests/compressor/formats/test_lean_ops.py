"""The lean ops a ``torch.compile`` graph holds for the CPU layers (``kernels/lean_ops.py``):
a compiled int8 layer (dense or packed N:M codes, per channel or per group, dynamic or static
activations) and a compiled low-rank layer run eager's kernels, bit for bit, at the token
counts on both sides of each kernel's limit; tracing with a gradient keeps the torch ops; the
fakes give shapes and dtypes."""

from __future__ import annotations

import pytest
import torch
from conftest import count_calls, requires_kernels

from lmcompress.compressor.formats.int8 import QuantLinear
from lmcompress.compressor.formats.low_rank import LowRankLinear
from lmcompress.compressor.formats.nm_packed_int8 import PackedNMInt8Linear
from lmcompress.kernels import cpu_kernels, lean_ops

pytestmark = requires_kernels


def _int8_layer(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48, bias=kind != "static")
    if kind == "packed":
        with torch.no_grad():
            linear.weight.mul_(torch.arange(64) % 4 < 2)
        return PackedNMInt8Linear.from_linear(linear, n=2, m=4)
    if kind == "static":
        return QuantLinear.from_linear(linear, activations="static", input_scale=0.02)
    return QuantLinear.from_linear(linear, group_size=16 if kind == "grouped" else None)


def _compiled_and_eager(layer, x):
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    with torch.inference_mode():
        return compiled(x), layer(x)


@pytest.mark.parametrize("kind", ["channel", "grouped", "static", "packed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, cpu_kernels.MAX_TOKENS, cpu_kernels.MAX_TOKENS + 1, 40])
def test_a_compiled_int8_layer_runs_the_eager_kernels_bit_for_bit(monkeypatch, kind, dtype, tokens):
    layer = _int8_layer(kind)
    x = torch.randn(1, tokens, 64).to(dtype)
    fused = count_calls(monkeypatch, cpu_kernels, "int8_linear")
    quantized = count_calls(monkeypatch, cpu_kernels, "int8_quantize")
    graph, eager = _compiled_and_eager(layer, x)
    assert torch.equal(graph, eager) and graph.dtype == dtype and graph.shape == (1, tokens, 48)
    # twice the eager count: the graph ran the same kernels (inductor's own quantize would not
    # call them); the fused pass for per-channel scales up to its token limit
    few = tokens <= cpu_kernels.MAX_TOKENS and kind != "grouped"
    assert fused["n"] == (2 if few else 0) and quantized["n"] == (0 if few else 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, cpu_kernels.LOW_RANK_MAX_TOKENS, 9])
def test_a_compiled_low_rank_layer_runs_the_eager_kernel(monkeypatch, dtype, tokens):
    torch.manual_seed(0)
    layer = LowRankLinear.from_linear(torch.nn.Linear(64, 48), rank=8).to(dtype)
    x = torch.randn(1, tokens, 64).to(dtype)
    kernel = count_calls(monkeypatch, cpu_kernels, "lowrank")
    graph, eager = _compiled_and_eager(layer, x)
    few = tokens <= cpu_kernels.LOW_RANK_MAX_TOKENS
    assert kernel["n"] == (2 if few else 0)
    if few:  # past the limit inductor runs the two linears its own way: close, not equal
        assert torch.equal(graph, eager)
    torch.testing.assert_close(graph, eager, rtol=1e-2, atol=1e-2)


def test_tracing_with_a_gradient_keeps_the_torch_ops(monkeypatch):
    x = torch.randn(1, 2, 64)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert lean_ops.traced_cpu(x, 64) and lean_ops.traced_cpu(x, 64, max_tokens=2)
    assert not lean_ops.traced_cpu(x, 64, max_tokens=1)  # 2 tokens past a limit of 1
    assert not lean_ops.traced_cpu(x, 63)
    assert not lean_ops.traced_cpu(x.half(), 64)
    assert not lean_ops.traced_cpu(x.requires_grad_(), 64)
    with torch.no_grad():
        assert lean_ops.traced_cpu(x, 64)
    monkeypatch.undo()
    assert not lean_ops.traced_cpu(x.detach(), 64)  # eager: the layers call the kernels
    low_rank = LowRankLinear.from_linear(torch.nn.Linear(64, 48), rank=8)
    low_rank.requires_grad_()  # factors trained (distillation): A, B need gradients
    kernel = count_calls(monkeypatch, cpu_kernels, "lowrank")
    torch._dynamo.reset()
    y = torch.compile(low_rank, dynamic=False)(torch.randn(1, 2, 64))
    y.sum().backward()
    assert kernel["n"] == 0 and low_rank.A.grad is not None


def test_the_fakes_give_shapes_and_dtypes():
    layer = _int8_layer("packed")
    low_rank = LowRankLinear.from_linear(torch.nn.Linear(64, 48), rank=8).to(torch.bfloat16)
    with torch._subclasses.FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(2, 3, 64, dtype=torch.bfloat16)
        y = lean_ops.int8_layer(
            x, layer.values, layer.weight_scale, None, layer.bias,
            nm=(layer.indices, 2, 4), in_features=64,
        )  # fmt: skip
        z = lean_ops.low_rank_layer(x, low_rank.A, low_rank.B, low_rank.bias)
    assert y.shape == z.shape == (2, 3, 48) and y.dtype == z.dtype == torch.bfloat16
