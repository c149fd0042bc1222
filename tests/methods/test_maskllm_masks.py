import math

import pytest
import torch

from lmcompress.compressor.sparsity import nm_mask
from lmcompress.methods.maskllm.masks import (
    candidate_patterns,
    gumbel_noise,
    hard_mask,
    init_logits,
    linear_schedule,
    prior_logits,
    soft_mask,
)


@pytest.mark.parametrize(("n", "m"), [(2, 4), (1, 4), (4, 8), (3, 8), (1, 2)])
def test_candidates_are_every_n_of_m_pattern(n, m):
    candidates = candidate_patterns(n, m)
    assert candidates.shape == (math.comb(m, n), m)
    assert torch.all(candidates.sum(1) == n)
    assert len({tuple(row.tolist()) for row in candidates}) == math.comb(m, n)  # all distinct


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


def test_schedule_endpoints():
    assert linear_schedule(4.0, 0.05, 0, 100) == 4.0
    assert linear_schedule(4.0, 0.05, 100, 100) == pytest.approx(0.05)
    assert linear_schedule(100.0, 500.0, 50, 100) == pytest.approx(300.0)
    assert linear_schedule(1.0, 2.0, 500, 100) == 2.0  # clamped after the end


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
