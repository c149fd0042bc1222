"""Plain bf16 linears of a loaded compressed model computing prefill in float32 where the CPU
emulates bf16 matmuls (``compressor/model/bf16_prefill.py``): which layers change, from how many
tokens, the same parameters and keys, and the runtimes that install it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import linear_dtypes
from torch import nn

from lmcompress import compress, load_compressed, save_compressed
from lmcompress.compressor.model import bf16_prefill
from lmcompress.compressor.model.bf16_prefill import MIN_TOKENS, Float32PrefillLinear
from lmcompress.kernels import gemm_dtype, int4_ops
from lmcompress.methods.magnitude import MagnitudeConfig


@pytest.mark.parametrize("bias", [True, False])
def test_from_min_tokens_the_matmul_runs_in_float32(monkeypatch, bias):
    monkeypatch.setattr(gemm_dtype, "native_bf16", lambda: False)
    torch.manual_seed(0)
    layer = nn.Linear(48, 40, bias=bias).bfloat16()
    weight, keys = layer.weight, set(layer.state_dict())
    plain = nn.Sequential(nn.Linear(48, 40).bfloat16(), nn.Linear(48, 40), layer)
    assert bf16_prefill.install(plain) == 2  # the two bf16 ones, not the fp32 one
    assert type(plain[1]) is nn.Linear and isinstance(layer, Float32PrefillLinear)
    assert layer.weight is weight and set(layer.state_dict()) == keys
    seen = linear_dtypes(monkeypatch)
    for tokens, compute in ((MIN_TOKENS, torch.float32), (MIN_TOKENS - 1, torch.bfloat16)):
        x = torch.randn(1, tokens, 48).bfloat16()
        got = layer(x)
        part = None if layer.bias is None else layer.bias.to(compute)
        want = F.linear(x.to(compute), layer.weight.to(compute), part).to(torch.bfloat16)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want), tokens
        assert seen[0] == {compute}, tokens
        seen.clear()


@pytest.mark.parametrize("bias", [True, False])
def test_float32_prefill_by_blocks_of_rows_covers_every_output(monkeypatch, bias):
    """Blocks of 16 rows over 40 outputs (16, 16, then 8): every column and its bias
    computed once, as the whole float32 matmul rounded to bf16 (within one bf16 step: BLAS
    may order a dot product differently by shape), for 3-d input too."""
    monkeypatch.setattr(int4_ops, "MIN_BLOCK_ROWS", 16)
    monkeypatch.setattr(int4_ops, "BLOCK_BYTES", 16 * 4 * 48)
    assert int4_ops.block_rows(48, torch.float32) == 16
    torch.manual_seed(0)
    layer = nn.Linear(48, 40, bias=bias).bfloat16()
    x = torch.randn(2, 24, 48).bfloat16()
    part = None if layer.bias is None else layer.bias.float()
    want = F.linear(x.float(), layer.weight.float(), part).bfloat16()
    for grad in (False, True):  # inference writes each block into the output; autograd cats
        with torch.set_grad_enabled(grad):
            got = bf16_prefill.float32_linear(x, layer.weight, layer.bias)
        assert got.shape == (2, 24, 40) and got.dtype == torch.bfloat16
        torch.testing.assert_close(got.detach(), want, rtol=2**-7, atol=0)


def test_nothing_changes_where_bf16_is_native(monkeypatch):
    monkeypatch.setattr(gemm_dtype, "native_bf16", lambda: True)
    model = nn.Sequential(nn.Linear(8, 8).bfloat16())
    assert bf16_prefill.install(model) == 0 and type(model[0]) is nn.Linear


@pytest.mark.parametrize("runtime", ["packed", "expanded", "dense"])
def test_load_installs_it_in_every_runtime(tmp_path, monkeypatch, runtime):
    """A bf16 2:4 export of a tiny llama (tied head): every runtime's plain linears become
    Float32PrefillLinear (the head still the embeddings' weight): the packed layers stay
    packed, the expanded and dense runtimes' decoder linears change too."""
    from conftest import make_tiny_model, make_tiny_tokenizer

    monkeypatch.setattr(gemm_dtype, "native_bf16", lambda: False)
    model = make_tiny_model("llama")
    report = compress(model, MagnitudeConfig(sparsity="2:4"))
    out = save_compressed(
        model, tmp_path / "out", report, tokenizer=make_tiny_tokenizer(), dtype=torch.bfloat16
    )
    loaded, _, _ = load_compressed(out, runtime=runtime)
    assert isinstance(loaded.lm_head, Float32PrefillLinear)
    if loaded.config.tie_word_embeddings:
        assert loaded.lm_head.weight is loaded.get_input_embeddings().weight
    decoder = [m for n, m in loaded.named_modules() if n.startswith("model.layers.")]
    changed = sum(isinstance(m, Float32PrefillLinear) for m in decoder)
    assert changed == (0 if runtime == "packed" else len(report.layers))
