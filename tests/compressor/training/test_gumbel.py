"""The generic learned-mask helpers: candidate N:M patterns, the Gumbel noise sources (their
moments, CDF and Gumbel-max frequencies; the pool's windows), the linear schedules."""

import math

import pytest
import torch

from lmcompress.compressor.training.gumbel import (
    GumbelPool,
    candidate_patterns,
    linear_schedule,
    pooled_gumbel_noise,
)

EULER_GAMMA = 0.5772156649015329


@pytest.mark.parametrize(("n", "m"), [(2, 4), (1, 4), (4, 8), (3, 8), (1, 2)])
def test_candidates_are_every_n_of_m_pattern(n, m):
    candidates = candidate_patterns(n, m)
    assert candidates.shape == (math.comb(m, n), m)
    assert torch.all(candidates.sum(1) == n)
    assert len({tuple(row.tolist()) for row in candidates}) == math.comb(m, n)  # all distinct


def test_schedule_endpoints():
    assert linear_schedule(4.0, 0.05, 0, 100) == 4.0
    assert linear_schedule(4.0, 0.05, 100, 100) == pytest.approx(0.05)
    assert linear_schedule(100.0, 500.0, 50, 100) == pytest.approx(300.0)
    assert linear_schedule(1.0, 2.0, 500, 100) == 2.0  # clamped after the end


@pytest.mark.parametrize(
    ("sampler", "is_gumbel"),
    [
        (pooled_gumbel_noise, True),
        (torch.rand, False),  # plain uniform noise
        (lambda shape: torch.randn(shape) * math.pi / math.sqrt(6) + EULER_GAMMA, False),
    ],
    ids=["pool", "uniform", "normal-with-gumbel-mean-and-variance"],
)
def test_pooled_noise_has_the_gumbel_moments_and_cdf(sampler, is_gumbel):
    """Mean γ ≈ 0.5772, variance π²/6, skewness 12√6 ζ(3)/π³ ≈ 1.1395, CDF exp(−e^−x); the
    tolerances pass the pool and fail wrong samplers."""
    torch.manual_seed(0)
    x = torch.cat([sampler((64, 1000, 6)).flatten() for _ in range(4)]).double()  # 1.5M values
    mean, var = float(x.mean()), float(x.var())
    skew = float(((x - mean) ** 3).mean()) / var**1.5
    points = torch.linspace(-2.0, 5.0, 29, dtype=torch.float64)
    empirical = (x[:, None] <= points).double().mean(0)
    ks = float((empirical - torch.exp(-torch.exp(-points))).abs().max())
    checks = (
        abs(mean - EULER_GAMMA) < 0.01,
        abs(var - math.pi**2 / 6) < 0.03,
        abs(skew - 1.1395) < 0.05,
        ks < 0.003,
    )
    assert all(checks) if is_gumbel else not all(checks), (mean, var, skew, ks)


def test_pooled_sampler_frequencies_match_the_softmax():
    """Gumbel-max with pooled noise follows softmax(κ·logits): the exact sampler's chi-square
    test, over several calls (random offsets) of the shared pool."""
    torch.manual_seed(0)
    logits = torch.tensor([0.3, -0.2, 0.0, 0.5, -1.0, 0.1])
    kappa, draws = 2.0, 60_000
    noise = torch.cat([pooled_gumbel_noise((draws // 10, 6)) for _ in range(10)])
    assert noise.shape == (draws, 6)
    picks = (logits * kappa + noise).argmax(1)
    observed = torch.bincount(picks, minlength=6).double()
    expected = torch.softmax(logits.double() * kappa, 0) * draws
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < 20.5  # 5 degrees of freedom: p ≈ 0.001


def test_pooled_noise_is_reproducible_under_manual_seed():
    pool = GumbelPool(size=1 << 12, seed=3)
    torch.manual_seed(7)
    first, second = pool.sample((50, 6)), pooled_gumbel_noise((50, 6))
    torch.manual_seed(7)
    assert torch.equal(pool.sample((50, 6)), first)
    assert torch.equal(pooled_gumbel_noise((50, 6)), second)
    assert not torch.equal(first, pool.sample((50, 6)))  # a new offset every call
    torch.testing.assert_close(GumbelPool(size=1 << 12, seed=3).values, pool.values)
    assert not torch.equal(GumbelPool(size=1 << 12, seed=4).values, pool.values)


@pytest.mark.parametrize("shape", [(7, 13), (3, 16), (5,), (2, 3, 4), (0, 6), (16,)])
def test_pooled_noise_is_a_circular_window_and_wraps_around(shape):
    pool = GumbelPool(size=16, seed=0)
    assert len(set(pool.values.tolist())) == 16  # distinct: a value fixes its pool position
    torch.manual_seed(0)
    for _ in range(5):
        out = pool.sample(shape)
        assert out.shape == shape and out.dtype == torch.float32 and out.is_contiguous()
        flat = out.flatten()
        if flat.numel() == 0:
            continue
        offset = int((pool.values == flat[0]).nonzero())
        index = (offset + torch.arange(flat.numel())) % pool.size
        assert torch.equal(flat, pool.values[index])
    out = pool.sample((9, 4), dtype=torch.float64)
    assert out.dtype == torch.float64
    assert torch.isin(out.float(), pool.values).all()
    before = pool.values.clone()
    pool.sample((40,)).add_(1.0)  # a fresh tensor: writing to it leaves the pool alone
    assert torch.equal(pool.values, before)
    assert torch.isin(pool.sample((40,)), before).all()
