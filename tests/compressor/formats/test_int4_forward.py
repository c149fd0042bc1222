"""A tiled int4 layer's decode under ``torch.compile`` (``formats/int4_forward.py``): the graph
holds the lean ``int4_decode`` op, not the general ``int4_linear``, on each layer's own
tensors (shared siblings included), and computes what eager does; past the decode
kernel's token limit, or with a gradient needed, the general path as before."""

from __future__ import annotations

import pytest
import torch
from conftest import count_calls, make_tiny_model, requires_kernels

from lmcompress import compress
from lmcompress.compressor.formats import int4_forward
from lmcompress.compressor.formats.int4 import Int4Linear
from lmcompress.compressor.formats.int4_shared import prepare_decode
from lmcompress.kernels import int4_ops, int4_tiles, lean_ops
from lmcompress.methods.gptq import RTNConfig

pytestmark = requires_kernels


def _int4_model(dtype):
    model = make_tiny_model("llama")
    compress(model, RTNConfig(bits=4, group_size=16))
    model = model.to(dtype).eval()
    prepare_decode(model)
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 16, 17])
def test_a_compiled_model_decodes_as_eager_through_the_lean_op(monkeypatch, dtype, tokens):
    model = _int4_model(dtype)
    layers = [m for m in model.modules() if type(m) is Int4Linear]
    assert all(m.tiled for m in layers) and any("shared_input" in m.__dict__ for m in layers)
    ids = torch.randint(3, 200, (1, tokens), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    compiled = torch.compile(model.forward, fullgraph=True, dynamic=False)
    with torch.inference_mode():
        eager = model(input_ids=ids, use_cache=False).logits
        kernel = count_calls(monkeypatch, int4_tiles, "_call")
        general = count_calls(monkeypatch, int4_ops, "linear")
        graph = compiled(input_ids=ids, use_cache=False).logits
    # the graph fuses the norms and the rest its own way: close, not equal (layer by layer
    # the op is eager bit for bit: test_compiled.py and test_the_op_equals_the_layer below)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(graph, eager, rtol=tol, atol=tol)
    if tokens <= int4_tiles.MAX_TOKENS:  # one kernel call per layer, none through int4_linear
        assert kernel["n"] == len(layers) and general["n"] == 0
    else:  # prefill: the general op for every layer
        assert kernel["n"] == 0 and general["n"] == len(layers)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3, 16, 20])
@pytest.mark.parametrize("bias", [False, True])
def test_the_op_equals_the_layer(dtype, tokens, bias):
    """The op alone (eager dispatch): the decode kernel up to 16 tokens, the general path past
    it, each bit for bit the layer's own forward; the fake gives the shape and dtype."""
    torch.manual_seed(0)
    layer = Int4Linear.from_linear(torch.nn.Linear(64, 48, bias=bias), group_size=16)
    assert layer.tiled
    x = torch.randn(2, tokens, 64).to(dtype)
    held = layer._buffers
    args = (held["qweight"], held["scales16"], held["zeros16"], held["bias"], 4, 16, 48)
    with torch.inference_mode():
        y = lean_ops.int4_decode(x, *args)
        assert torch.equal(y, layer(x))
        assert y.shape == (2, tokens, 48) and y.dtype == dtype
        with torch._subclasses.FakeTensorMode(allow_non_fake_inputs=True):
            fake = lean_ops.int4_decode(torch.empty(2, tokens, 64, dtype=dtype), *args)
    assert fake.shape == (2, tokens, 48) and fake.dtype == dtype


def test_tracing_with_a_gradient_takes_the_general_path(monkeypatch):
    layer = Int4Linear.from_linear(torch.nn.Linear(64, 48), group_size=16)
    x = torch.randn(1, 64, requires_grad=True)
    used = count_calls(monkeypatch, lean_ops, "int4_decode")
    torch._dynamo.reset()
    y = torch.compile(layer, dynamic=False)(x)  # (the general path's tracing breaks the graph)
    y.sum().backward()
    assert used["n"] == 0 and x.grad is not None
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert int4_forward.tiled_forward(layer, x) is None  # traced with a gradient: general
    with torch.no_grad():
        assert int4_forward.tiled_forward(layer, x) is not None
