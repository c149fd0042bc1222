import pytest
import torch

from lmcompress.compressor.sparsity import nm_mask
from lmcompress.compressor.training.gumbel import (
    candidate_patterns,
    gumbel_noise,
)
from lmcompress.methods.maskllm.masks import hard_mask, init_logits, prior_logits, soft_mask

EULER_GAMMA = 0.5772156649015329


@pytest.mark.parametrize(("n", "m"), [(2, 4), (4, 8)])
@pytest.mark.parametrize("tau", [4.0, 0.05])
def test_soft_mask_groups_sum_to_n_and_hard_mask_is_exact(n, m, tau):
    candidates = candidate_patterns(n, m)
    logits = init_logits(500, len(candidates), generator=torch.Generator().manual_seed(0))
    noise = gumbel_noise(logits.shape, generator=torch.Generator().manual_seed(1))
    soft = soft_mask(logits, candidates, tau=tau, kappa=100.0, noise=noise)
    torch.testing.assert_close(soft.sum(1), torch.full((500,), float(n)))
    assert torch.all((soft >= 0) & (soft <= 1 + 1e-6))
    hard = hard_mask(logits, candidates)
    assert torch.all(hard.sum(1) == n) and set(hard.unique().tolist()) <= {0.0, 1.0}


@pytest.mark.parametrize("strength", [3.0, 0.5])
def test_step0_argmax_equals_the_prior(strength):
    torch.manual_seed(0)
    candidates = candidate_patterns(2, 4)
    W = torch.randn(64, 256)
    prior = nm_mask(W.abs(), 2, 4).reshape(-1, 4)  # (G, 4)
    logits = init_logits(prior.shape[0], 6, generator=torch.Generator().manual_seed(0))
    loose = prior_logits(logits, prior, candidates, strength=strength, exact=False)
    exact = prior_logits(logits, prior, candidates, strength=strength, exact=True)
    assert torch.equal(hard_mask(exact, candidates).bool(), prior)
    flipped = (hard_mask(loose, candidates).bool() != prior).any(1).float().mean()
    assert flipped > 0  # the paper's formula alone lets init noise flip some groups
    changed = (exact != loose).any(1)
    assert changed.float().mean() == pytest.approx(float(flipped), abs=1e-6)  # only those move


def test_gumbel_sampler_frequencies_match_the_softmax():
    """Hard Gumbel-max samples of one group follow softmax(κ·logits): a chi-square test."""
    candidates = candidate_patterns(2, 4)
    logits = torch.tensor([0.3, -0.2, 0.0, 0.5, -1.0, 0.1])
    kappa, draws = 2.0, 60_000
    noise = gumbel_noise((draws, 6), generator=torch.Generator().manual_seed(0))
    picks = (logits * kappa + noise).argmax(1)
    observed = torch.bincount(picks, minlength=6).double()
    expected = torch.softmax(logits.double() * kappa, 0) * draws
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < 20.5  # 5 degrees of freedom: p ≈ 0.001
    # and the soft mask at low temperature approaches the sampled hard pattern
    soft = soft_mask(logits[None].expand(4, 6), candidates, tau=1e-3, kappa=kappa, noise=noise[:4])
    torch.testing.assert_close(soft, candidates[picks[:4]])


def _noise_and_logits(groups: int = 200, c: int = 6):
    logits = init_logits(groups, c, std=0.3, generator=torch.Generator().manual_seed(0))
    noise = gumbel_noise(logits.shape, generator=torch.Generator().manual_seed(1))
    return logits.requires_grad_(True), noise


@pytest.mark.parametrize(("n", "m"), [(2, 4), (4, 8), (1, 2)])
def test_straight_through_forward_is_the_sampled_nm_pattern(n, m):
    candidates = candidate_patterns(n, m)
    logits, noise = _noise_and_logits(c=len(candidates))
    mask = soft_mask(logits, candidates, tau=4.0, kappa=5.0, noise=noise, hard=True)
    assert set(mask.detach().unique().tolist()) <= {0.0, 1.0}
    assert torch.all(mask.sum(1) == n)
    sampled = (logits.detach() * 5.0 + noise).argmax(1)
    assert torch.equal(mask.detach(), candidates[sampled])  # the Gumbel-max pattern, exactly
    # every group is a candidate row
    matches = (mask.detach()[:, None, :] == candidates[None]).all(-1).sum(1)
    assert torch.all(matches == 1)
    # without noise: the argmax of the logits, i.e. the hard mask
    plain = soft_mask(logits, candidates, tau=4.0, kappa=5.0, hard=True)
    assert torch.equal(plain.detach(), hard_mask(logits.detach(), candidates))


@pytest.mark.parametrize("tau", [4.0, 0.5])
def test_straight_through_gradient_is_the_soft_masks(tau):
    candidates = candidate_patterns(2, 4)
    logits, noise = _noise_and_logits()
    upstream = torch.randn(200, 4, generator=torch.Generator().manual_seed(2))
    st = soft_mask(logits, candidates, tau=tau, kappa=3.0, noise=noise, hard=True)
    (st_grad,) = torch.autograd.grad((st * upstream).sum(), logits)
    soft = soft_mask(logits, candidates, tau=tau, kappa=3.0, noise=noise)
    (soft_grad,) = torch.autograd.grad((soft * upstream).sum(), logits)
    assert st_grad.abs().sum() > 0
    torch.testing.assert_close(st_grad, soft_grad, rtol=0, atol=0)
    assert not torch.equal(st.detach(), soft.detach())


@pytest.mark.parametrize("source", ["exact", "pool"])
@pytest.mark.parametrize("hard", [False, True])
def test_replayed_soft_mask_matches_autograd(source, hard):
    """The memory-lean mask (noise replayed, softmax recomputed in backward) has the value and
    the logits gradient of plain autograd through ``soft_mask`` with the same noise."""
    from lmcompress.compressor.training.gumbel import replayable_noise
    from lmcompress.methods.maskllm.masks import soft_mask_replayed

    candidates = candidate_patterns(2, 4)
    logits = torch.randn(64, 6, generator=torch.Generator().manual_seed(1)) * 0.05
    torch.manual_seed(3)
    noise_fn = replayable_noise(source, logits.shape)
    noise = noise_fn()
    assert torch.equal(noise_fn(), noise)  # the replay is the same sample
    weights = torch.randn(64, 4, generator=torch.Generator().manual_seed(2))

    lean = logits.clone().requires_grad_(True)
    value = soft_mask_replayed(lean, candidates, 1.5, 100.0, noise_fn, hard)
    (value * weights).sum().backward()
    plain = logits.clone().requires_grad_(True)
    expected = soft_mask(plain, candidates, 1.5, 100.0, noise, hard=hard)
    (expected * weights).sum().backward()
    torch.testing.assert_close(value, expected.detach())
    torch.testing.assert_close(lean.grad, plain.grad, rtol=1e-4, atol=1e-4)  # scale κ/τ ≈ 67
    assert lean.grad.abs().sum() > 0


def test_replayed_soft_mask_stays_fp32_under_bf16_autocast():
    """Under autocast the mask is computed in the logits' dtype (a bf16 matmul would round it)
    and the backward takes a bf16 upstream gradient (from bf16 layers) without a dtype error."""
    from lmcompress.compressor.training.gumbel import replayable_noise
    from lmcompress.methods.maskllm.masks import soft_mask_replayed

    candidates = candidate_patterns(2, 4)
    logits = torch.randn(64, 6, generator=torch.Generator().manual_seed(1)) * 0.05
    torch.manual_seed(3)
    noise_fn = replayable_noise("exact", logits.shape)
    reference = logits.clone().requires_grad_(True)
    expected = soft_mask_replayed(reference, candidates, 1.5, 100.0, noise_fn)
    upstream = torch.randn(64, 4, generator=torch.Generator().manual_seed(2))
    upstream = upstream.to(torch.bfloat16)  # what bf16 layers send back
    (expected * upstream.float()).sum().backward()

    lean = logits.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        value = soft_mask_replayed(lean, candidates, 1.5, 100.0, noise_fn)
    assert value.dtype == torch.float32
    torch.testing.assert_close(value, expected.detach(), rtol=0, atol=0)
    value.backward(upstream)
    assert lean.grad.dtype == torch.float32
    torch.testing.assert_close(lean.grad, reference.grad, rtol=1e-5, atol=1e-5)
