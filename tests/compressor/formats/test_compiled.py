"""``torch.compile`` of every compressed runtime computes what eager does (within rounding): the
ops have fake implementations, so the compiled graph runs the same kernels."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model, make_tiny_tokenizer, requires_kernels

from lmcompress import compress, load_compressed, save_compressed
from lmcompress.compressor.formats.compose import compose_
from lmcompress.methods.gptq import GPTQConfig, RTNConfig
from lmcompress.methods.int8 import Int8Config
from lmcompress.methods.magnitude import MagnitudeConfig
from lmcompress.methods.svd import SVDConfig

DATA = torch.randint(3, 256, (4, 32), generator=torch.Generator().manual_seed(0))
RUNTIMES = {
    "nm_packed": [MagnitudeConfig(sparsity="2:4")],
    "low_rank": [SVDConfig(ratio=0.8)],
    "int8": [Int8Config()],
    "int8_softmax": [Int8Config(softmax_bits=8, bias_correction="head")],
    "nm_packed_int8": [MagnitudeConfig(sparsity="2:4"), Int8Config()],
    "int4": [RTNConfig(group_size=16)],
    "nm_packed_int4": [GPTQConfig(sparsity="2:4", group_size=16)],
}


@pytest.mark.parametrize("runtime", sorted(RUNTIMES))
def test_compiled_equals_eager(runtime, tmp_path):
    model = make_tiny_model("llama")
    reports = [compress(model, config, DATA) for config in RUNTIMES[runtime]]
    report = compose_(model, reports) if len(reports) > 1 else reports[0]
    save_compressed(model, tmp_path / "out", report, tokenizer=make_tiny_tokenizer())
    model, _, _ = load_compressed(tmp_path / "out", runtime="packed")
    torch._dynamo.reset()
    compiled = torch.compile(model.forward, dynamic=False)
    # 64 tokens (packed N:M unpacks, then torch's matmul) and 3 (its kernels read the packed
    # form: eager calls them directly, the compiled graph through the ops)
    for ids in (DATA[:2], DATA[:1, :3]):
        with torch.inference_mode():
            eager = model(input_ids=ids, use_cache=False).logits
            graph = compiled(input_ids=ids, use_cache=False).logits
        torch.testing.assert_close(graph, eager, rtol=1e-4, atol=1e-4)


@requires_kernels
@pytest.mark.parametrize("nm", [False, True])
@pytest.mark.parametrize("tokens", [1, 9])
def test_a_compiled_int4_layer_runs_the_eager_kernels_bit_for_bit(nm, tokens):
    """The compiled graph holds the int4 op, which runs what eager runs: for one token the
    decode kernel (int16 activations), which the torch-op fallback a graph would otherwise
    trace (float activations) does not equal bit for bit; for 9 the tiled decode kernel (dense
    codes, up to 16 tokens) or the blocked dequantization (packed N:M codes)."""
    from lmcompress.compressor.formats.int4 import Int4Linear, PackedNMInt4Linear

    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48)
    if nm:
        with torch.no_grad():
            linear.weight.mul_(torch.arange(64) % 4 < 2)
        layer = PackedNMInt4Linear.from_linear(linear, n=2, m=4, group_size=16)
    else:
        layer = Int4Linear.from_linear(linear, group_size=16)
    x = torch.randn(tokens, 64)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    with torch.inference_mode():
        eager, graph = layer(x), compiled(x)
        fallback = torch.nn.functional.linear(x, layer.dense_weight(), layer.bias)
    assert torch.equal(graph, eager)
    if tokens == 1:
        assert not torch.equal(eager, fallback)
