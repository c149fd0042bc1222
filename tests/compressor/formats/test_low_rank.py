"""The ``low_rank`` format: truncated SVD, LowRankLinear on Linear and GPT-2 Conv1D, state
round trips."""

import json

import pytest
import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from lmcompress.compressor.formats.base import CompressedLinear
from lmcompress.compressor.formats.catalog import format_class
from lmcompress.compressor.formats.low_rank import LowRankLinear, truncated_svd
from lmcompress.errors import ConfigError, ModelLoadError


def _randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _linear(out_features, in_features, bias=True, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias)


@pytest.mark.parametrize("rank", [1, 8, 24])
def test_truncated_svd_is_the_best_rank_r_approximation(rank):
    W = _randn(48, 80)  # (out, in)
    A, B = truncated_svd(W, rank)
    assert A.shape == (rank, 80) and B.shape == (48, rank)
    approx = B @ A
    assert torch.linalg.matrix_rank(approx) <= rank
    S = torch.linalg.svdvals(W.double())
    optimum = S[rank:].square().sum().sqrt()  # Eckart–Young: the smallest possible error
    assert float((W.double() - approx.double()).norm()) == pytest.approx(float(optimum), rel=1e-5)


def test_truncated_svd_splits_the_singular_values_evenly():
    W = _randn(40, 64, seed=1)
    A, B = truncated_svd(W, 16)
    root = torch.linalg.svdvals(W)[:16].sqrt()
    torch.testing.assert_close(A.norm(dim=1), root, rtol=1e-5, atol=0)  # rows of A
    torch.testing.assert_close(B.norm(dim=0), root, rtol=1e-5, atol=0)  # columns of B


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_rank_r_weight_is_reproduced(dtype):
    W = _randn(64, 8, seed=2, dtype=dtype) @ _randn(8, 40, seed=3, dtype=dtype)  # rank 8
    A, B = truncated_svd(W, 8)
    assert A.dtype == B.dtype == dtype
    assert float((W - B @ A).norm() / W.norm()) < 1e-5


@pytest.mark.parametrize("rank", [0, -1, 33])
def test_impossible_rank_is_a_config_error(rank):
    with pytest.raises(ConfigError, match="rank"):
        truncated_svd(_randn(32, 48), rank)


@pytest.mark.parametrize("bias", [True, False])
def test_from_linear_computes_with_its_dense_weight(bias):
    linear = _linear(48, 32, bias=bias)
    module = LowRankLinear.from_linear(linear, rank=8)
    assert isinstance(module, CompressedLinear) and module.format == "low_rank"
    assert (module.in_features, module.out_features, module.rank) == (32, 48, 8)
    assert (module.bias is None) == (not bias)
    W = module.dense_weight()  # (out, in)
    assert W.shape == (48, 32) and torch.linalg.matrix_rank(W) <= 8
    x = _randn(3, 5, 32, seed=4)  # (B, T, in)
    y = module(x)  # (B, T, out)
    torch.testing.assert_close(y, nn.functional.linear(x, W, linear.bias), rtol=1e-5, atol=1e-6)
    dense = module.to_dense()
    assert type(dense) is nn.Linear and (dense.bias is None) == (not bias)
    torch.testing.assert_close(dense(x), y, rtol=1e-5, atol=1e-6)


def test_full_rank_reproduces_the_layer():
    linear = _linear(24, 16)
    module = LowRankLinear.from_linear(linear, rank=16)
    x = _randn(7, 16, seed=5)
    torch.testing.assert_close(module(x), linear(x), rtol=1e-5, atol=1e-5)


def test_conv1d_weight_is_read_as_in_by_out():
    torch.manual_seed(0)
    conv = Conv1D(nf=48, nx=32)  # weight (in=32, out=48)
    nn.init.normal_(conv.bias)
    module = LowRankLinear.from_linear(conv, rank=32)  # full rank: the same function
    assert module.conv1d and (module.in_features, module.out_features) == (32, 48)
    x = _randn(2, 6, 32, seed=6)
    torch.testing.assert_close(module(x), conv(x), rtol=1e-5, atol=1e-5)

    low = LowRankLinear.from_linear(conv, rank=8)
    A, B = truncated_svd(conv.weight.t(), 8)
    assert torch.equal(low.A, A) and torch.equal(low.B, B)
    dense = low.to_dense()
    assert isinstance(dense, Conv1D) and dense.weight.shape == (32, 48)
    torch.testing.assert_close(dense(x), low(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "make",
    [
        lambda: _linear(48, 32, bias=True),
        lambda: _linear(16, 40, bias=False),
        lambda: Conv1D(24, 32),
    ],
    ids=["linear-bias", "linear-no-bias", "conv1d"],
)
def test_state_round_trip_is_exact(make):
    module = LowRankLinear.from_linear(make(), rank=8)
    meta = json.loads(json.dumps(module.meta()))  # what a manifest stores
    rebuilt = LowRankLinear.from_state(module.state_tensors(), meta)
    assert rebuilt.meta() == module.meta()
    assert module.state_tensors().keys() == rebuilt.state_tensors().keys()
    for key, value in module.state_tensors().items():
        assert torch.equal(rebuilt.state_tensors()[key], value), key
    x = _randn(4, module.in_features, seed=7)
    assert torch.equal(rebuilt(x), module(x))
    assert torch.equal(rebuilt.dense_weight(), module.dense_weight())


def test_from_state_refuses_wrong_tensors():
    module = LowRankLinear.from_linear(_linear(48, 32), rank=8)
    tensors, meta = module.state_tensors(), module.meta()
    with pytest.raises(ModelLoadError, match="missing tensor bias"):
        LowRankLinear.from_state({"A": tensors["A"], "B": tensors["B"]}, meta)  # bias missing
    with pytest.raises(ModelLoadError, match="shape"):
        LowRankLinear.from_state({**tensors, "A": tensors["A"][:4]}, meta)


def test_half_precision_factors_keep_the_dtype():
    linear = _linear(48, 32).to(torch.bfloat16)
    module = LowRankLinear.from_linear(linear, rank=16)
    assert module.A.dtype == module.B.dtype == module.bias.dtype == torch.bfloat16
    assert module.dense_weight().dtype == torch.bfloat16
    assert module(_randn(2, 32, seed=8).to(torch.bfloat16)).dtype == torch.bfloat16


def test_registered_under_its_format_name():
    assert format_class("low_rank") is LowRankLinear


def test_training_only_b_keeps_its_gradient_at_few_tokens():
    """With only ``B`` trainable (A frozen), a forward of a few tokens must stay on autograd's
    path: ``B.grad`` of ``sum(y)`` is ``Σ_tokens (x Aᵀ)`` in every row."""
    torch.manual_seed(0)
    layer = LowRankLinear.from_linear(nn.Linear(16, 12), 4)
    layer.B.requires_grad_(True)
    layer.A.requires_grad_(False)
    x = torch.randn(1, 2, 16)  # under the low-rank kernel's token limit
    layer(x).sum().backward()
    assert layer.B.grad is not None, "the forward took a kernel without autograd"
    expected = (x.reshape(-1, 16) @ layer.A.detach().T).sum(0).expand(12, -1)  # (out, rank)
    torch.testing.assert_close(layer.B.grad, expected, rtol=1e-5, atol=1e-6)
