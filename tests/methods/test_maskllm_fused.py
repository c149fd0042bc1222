"""The fused soft-mask kernel (``maskllm.fused``, ``kernels.soft_mask``) against the torch path:
same masked weights and logit gradients for the same noise, the counter noise's distribution,
and the same training with the kernel on or off."""

import math

import pytest
import torch
from conftest import requires_kernels

from lmcompress import MaskLLMConfig, compress
from lmcompress.compressor.training.gumbel import (
    GumbelPool,
    candidate_patterns,
    counter_gumbel,
    replayable_noise,
)
from lmcompress.methods.maskllm import fused
from lmcompress.methods.maskllm.masks import soft_mask_replayed
from lmcompress.methods.maskllm.parametrization import LearnableNMMask

pytestmark = requires_kernels


def _both(n, m, noise, hard, groups=3000, seed=0):
    """(fused, torch) masked weights and logit gradients for the same noise draw."""
    gen = torch.Generator().manual_seed(seed)
    C = candidate_patterns(n, m)
    W = torch.randn(groups, m, generator=gen)
    logits = (torch.randn(groups, C.shape[0], generator=gen) * 0.5).requires_grad_()
    grad = torch.randn(groups, m, generator=gen)
    results = []
    for use_kernel in (True, False):
        torch.manual_seed(seed)
        if use_kernel:
            out = fused.masked_weight(logits, W, C, 1.5, 3.0, noise, hard)
        else:
            noise_fn = replayable_noise(noise, logits.shape)
            out = W * soft_mask_replayed(logits, C, 1.5, 3.0, noise_fn, hard)
        out.backward(grad)
        results.append((out.detach(), logits.grad.clone()))
        logits.grad = None
    return results


@pytest.mark.parametrize("noise", ["pool", "counter"])
@pytest.mark.parametrize("hard", [False, True])
@pytest.mark.parametrize(("n", "m"), [(2, 4), (4, 8), (1, 4)])
def test_kernel_equals_torch_path(n, m, noise, hard):
    (out, grad), (ref_out, ref_grad) = _both(n, m, noise, hard)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-6)
    assert grad.abs().sum() > 0  # the gradient reaches the logits


def test_pool_window_wraps_like_the_pool():
    """A window that runs past the pool's end continues at its start, as ``GumbelPool.sample``:
    the kernel's hard argmax over zero logits is the argmax of the pool's window."""
    from lmcompress.kernels import soft_mask as kernel

    C, pool = candidate_patterns(2, 4), GumbelPool(size=1000, seed=1)
    logits = torch.zeros(700, 6)  # 4200 values: the window wraps four times
    for offset in (0, 7, 999):
        expected = C[pool.sample((700, 6), offset=offset).argmax(-1)]
        doubled = pool.doubled(torch.device("cpu"), torch.float32)
        got = kernel.soft_mask_forward(logits, C, 1.0, 1.0, (doubled, offset, 0), True, 0, None)
        assert torch.equal(got, expected), offset


def test_counter_noise_is_gumbel_and_replayable():
    a, b = counter_gumbel((200_000,), 7), counter_gumbel((200_000,), 8)
    assert torch.equal(a, counter_gumbel((200_000,), 7))
    assert not torch.equal(a, b)
    assert abs(float(a.mean()) - 0.5772) < 0.01  # Euler-Mascheroni
    assert abs(float(a.std()) - math.pi / math.sqrt(6)) < 0.01
    assert bool(torch.isfinite(a).all())
    # the Gumbel-max trick: argmax(log p + g) ~ p
    p = torch.tensor([0.5, 0.3, 0.2])
    g = counter_gumbel((60_000, 3), 3)
    freq = torch.bincount((p.log() + g).argmax(-1), minlength=3) / 60_000
    torch.testing.assert_close(freq, p, atol=0.01, rtol=0)


def test_weight_gradient_when_the_weight_trains():
    C = candidate_patterns(2, 4)
    logits = torch.randn(50, 6)
    W = torch.randn(50, 4, requires_grad=True)
    torch.manual_seed(0)
    fused.masked_weight(logits, W, C, 1.0, 2.0, "counter").sum().backward()
    torch.manual_seed(0)
    mask = soft_mask_replayed(logits, C, 1.0, 2.0, replayable_noise("counter", logits.shape))
    torch.testing.assert_close(W.grad, mask, rtol=1e-5, atol=1e-6)


def test_parametrization_takes_the_kernel_only_where_it_applies(monkeypatch):
    calls = []
    monkeypatch.setattr(fused, "masked_weight", lambda *a: calls.append(1) or a[1])
    W = torch.randn(8, 16)
    mask = LearnableNMMask(torch.randn(32, 6), 2, 4, (8, 16))
    for noise, hard, expected in (("pool", False, 1), ("counter", False, 1), ("exact", False, 0),
                                  ("pool", True, 0)):  # fmt: skip
        calls.clear()
        mask.noise, mask.hard = noise, hard
        mask(W)
        assert len(calls) == expected, (noise, hard)
    mask.noise, mask.hard, mask.use_kernel = "pool", False, False
    calls.clear()
    mask(W)
    assert not calls


@pytest.mark.parametrize("noise", ["pool", "counter"])
def test_training_is_the_same_with_and_without_the_kernel(noise, monkeypatch):
    from conftest import make_tiny_model

    data = torch.randint(3, 256, (8, 32), generator=torch.Generator().manual_seed(0))
    config = MaskLLMConfig(sparsity="2:4", steps=4, lr=0.05, batch_size=2, noise=noise,
                           prior="magnitude")  # fmt: skip
    logits = []
    for use_kernel in (True, False):
        monkeypatch.setattr(LearnableNMMask, "use_kernel", use_kernel)
        model = make_tiny_model("llama")
        _, stats = compress(model, config, data, return_stats=True)
        logits.append(stats.tensors)
    assert logits[0].keys() == logits[1].keys()
    for name in logits[0]:  # AdamW magnifies float rounding where a gradient is tiny
        torch.testing.assert_close(logits[0][name], logits[1][name], rtol=1e-3, atol=1e-4)
        assert torch.equal(logits[0][name].argmax(-1), logits[1][name].argmax(-1)), name


def test_group_argmax_is_torchs():
    from lmcompress.kernels.soft_mask import group_argmax

    logits = torch.randn(5000, 6)
    logits[3] = 1.0  # ties: the first
    logits[4, 2] = float("nan")  # NaN: the first NaN, as torch
    assert torch.equal(group_argmax(logits), logits.argmax(-1).to(torch.uint8))
