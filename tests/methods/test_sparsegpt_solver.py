import logging

import pytest
import torch

from lmcompress.compressor.calibration.observers import HessianAccumulator
from lmcompress.compressor.config import Sparsity
from lmcompress.compressor.sparsity import mask_from_scores
from lmcompress.errors import ConfigError, LmcompressError
from lmcompress.methods.sparsegpt.solver import (
    inverse_hessian_factor,
    reconstruction_error,
    sparsegpt_prune,
)

OUT, IN, TOKENS = 48, 96, 1024
PATTERNS = {"50%": Sparsity(ratio=0.5), "2:4": Sparsity(n=2, m=4), "4:8": Sparsity(n=4, m=8)}


def correlated_inputs(tokens=TOKENS, features=IN, seed=0):
    """X = (Z A) · s: mixed features (off-diagonal H) with uneven per-feature scales."""
    g = torch.Generator().manual_seed(seed)
    Z = torch.randn(tokens, features, generator=g)
    A = torch.eye(features) + torch.randn(features, features, generator=g) / features**0.5
    scales = torch.exp(torch.randn(features, generator=g))
    return (Z @ A) * scales  # (tokens, in)


def problem(seed=0):
    X = correlated_inputs(seed=seed)
    W = torch.randn(OUT, IN, generator=torch.Generator().manual_seed(seed + 1))
    return W, X, 2 / X.shape[0] * X.T @ X


def oracle_prune(W, H, sparsity, mask_every, percdamp=0.01):
    """SparseGPT without lazy batching: every column update is applied to the whole matrix
    at once; the mask is chosen every ``mask_every`` columns. Float64."""
    W, H = W.double().clone(), H.double().clone()
    H.diagonal().add_(percdamp * H.diagonal().mean())
    U = torch.linalg.cholesky(torch.linalg.inv(H), upper=True)
    d = U.diagonal()
    keep = torch.ones_like(W, dtype=torch.bool)
    for j in range(W.shape[1]):
        if sparsity.is_nm and j % sparsity.m == 0:
            g = slice(j, j + sparsity.m)
            keep[:, g] = mask_from_scores(W[:, g] ** 2 / d[g] ** 2, sparsity)
        elif not sparsity.is_nm and j % mask_every == 0:
            g = slice(j, j + mask_every)
            keep[:, g] = mask_from_scores(W[:, g] ** 2 / d[g] ** 2, sparsity)
        e = torch.where(keep[:, j], 0.0, W[:, j] / d[j])
        W[:, j:] -= torch.outer(e, U[j, j:])
    return W * keep, keep


def test_hessian_matches_closed_form_for_any_batching():
    X = correlated_inputs()
    expected = 2 / X.shape[0] * X.T @ X
    whole = HessianAccumulator(IN)
    whole.add_batch(X.reshape(8, -1, IN))  # (batch, seq, in): leading dims are tokens
    pieces = HessianAccumulator(IN)
    for chunk in X.split([1, 99, 300, 624]):
        pieces.add_batch(chunk)
    pieces.add_batch(X[:0])  # an empty batch changes nothing
    assert whole.nsamples == pieces.nsamples == TOKENS
    torch.testing.assert_close(whole.H, expected, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(pieces.H, expected, rtol=1e-5, atol=1e-4)
    wide = HessianAccumulator(IN, dtype=torch.float64)
    wide.add_batch(X.double())
    assert wide.H.dtype == torch.float64
    torch.testing.assert_close(wide.H, 2 / TOKENS * X.double().T @ X.double())


def test_hessian_rejects_wrong_features_and_dtype():
    with pytest.raises(ConfigError):
        HessianAccumulator(IN).add_batch(torch.randn(4, IN + 1))
    with pytest.raises(ConfigError):
        HessianAccumulator(IN, dtype=torch.float16)


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_beats_magnitude_and_wanda(pattern):
    sparsity = PATTERNS[pattern]
    W, X, H = problem()
    W_sgpt, _ = sparsegpt_prune(W, H, sparsity)
    magnitude = W * mask_from_scores(W.abs(), sparsity)
    wanda = W * mask_from_scores(W.abs() * X.norm(dim=0), sparsity, per_row=True)
    errors = {
        "sparsegpt": reconstruction_error(W, W_sgpt, X),
        "wanda": reconstruction_error(W, wanda, X),
        "magnitude": reconstruction_error(W, magnitude, X),
    }
    assert 0 < errors["sparsegpt"] < errors["wanda"] < errors["magnitude"], errors
    assert errors["sparsegpt"] < 0.95 * errors["wanda"], errors  # ~0.86-0.88 here


@pytest.mark.parametrize("pattern", ["2:4", "4:8"])
def test_nm_invariants(pattern):
    sparsity = PATTERNS[pattern]
    W, _, H = problem()
    W_new, keep = sparsegpt_prune(W, H, sparsity, blocksize=32)
    assert keep.dtype == torch.bool and keep.shape == W.shape
    assert torch.all(keep.reshape(-1, sparsity.m).sum(1) == sparsity.n)
    assert torch.equal(W_new != 0, keep)  # zero exactly where pruned, and only there


@pytest.mark.parametrize("blocksize", [8, 40, 128])  # 40 does not divide IN=96; 128 > IN
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_matches_unbatched_oracle(pattern, blocksize):
    """Lazy batch updates are an exact regrouping of the column-by-column OBS updates."""
    sparsity = PATTERNS[pattern]
    W, _, H = problem(seed=3)
    W_new, keep = sparsegpt_prune(W, H, sparsity, blocksize=blocksize)
    W_ref, keep_ref = oracle_prune(W, H, sparsity, mask_every=blocksize)
    assert torch.equal(keep, keep_ref)  # no near-ties for this seed (max |ΔW| ~ 1e-6)
    torch.testing.assert_close(W_new, W_ref.float(), rtol=0, atol=1e-5)


def test_inverse_factor_matches_reference_construction():
    _, _, H = problem()
    H = H.double()
    U = inverse_hessian_factor(H, percdamp=0.01)
    Hd = H + 0.01 * H.diagonal().mean() * torch.eye(IN, dtype=H.dtype)
    # The reference: cholesky -> cholesky_inverse -> upper cholesky of the inverse.
    expected = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(Hd)), upper=True)
    assert torch.equal(U, U.triu()) and torch.all(U.diagonal() > 0)
    torch.testing.assert_close(U, expected, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(U.T @ U @ Hd, torch.eye(IN, dtype=H.dtype), rtol=0, atol=1e-8)


def test_identity_hessian_reduces_to_magnitude():
    """H = I: d_j is constant and U has no off-diagonal, so nothing is updated."""
    W, _, _ = problem()
    H = torch.eye(IN)
    for sparsity in PATTERNS.values():
        W_new, keep = sparsegpt_prune(W, H, sparsity, blocksize=IN)
        assert torch.equal(keep, mask_from_scores(W.abs(), sparsity)), sparsity
        assert torch.equal(W_new, W * keep), sparsity


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_without_weight_update_keeps_original_weights(pattern):
    sparsity = PATTERNS[pattern]
    W, _, H = problem()
    W_upd, keep_upd = sparsegpt_prune(W, H, sparsity)
    W_orig, keep_orig = sparsegpt_prune(W, H, sparsity, update_weights=False)
    assert torch.equal(keep_orig, keep_upd)
    assert torch.equal(W_orig, W * keep_orig)
    assert not torch.equal(W_upd, W_orig)


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_dead_inputs_end_up_zero(pattern):
    sparsity = PATTERNS[pattern]
    W, X, _ = problem()
    dead = torch.tensor([0, 5, 6, 7, 50, 95])
    X[:, dead] = 0
    acc = HessianAccumulator(IN)
    acc.add_batch(X)
    H_before = acc.H.clone()
    W_new, keep = sparsegpt_prune(W, acc.H, sparsity, blocksize=32)
    assert torch.isfinite(W_new).all()
    assert torch.all(W_new[:, dead] == 0)
    assert torch.equal(acc.H, H_before)  # the caller's Hessian is not modified
    if sparsity.is_nm:
        assert torch.all(keep.reshape(-1, sparsity.m).sum(1) == sparsity.n)


@pytest.mark.parametrize("blocksize", [16, 40, 96, 128])
def test_unstructured_sparsity_per_block(blocksize):
    W, _, H = problem()
    ratio = 0.6
    _, keep = sparsegpt_prune(W, H, Sparsity(ratio=ratio), blocksize=blocksize)
    for i1 in range(0, IN, blocksize):  # 40 leaves a last block of 16 columns
        block = keep[:, i1 : i1 + blocksize]
        assert int((~block).sum()) == int(block.numel() * ratio), (blocksize, i1)


def test_blocksize_not_multiple_of_m_keeps_groups_aligned():
    W, _, H = problem()
    sparsity = PATTERNS["4:8"]
    W_new, keep = sparsegpt_prune(W, H, sparsity, blocksize=30)  # rounded down to 24
    assert torch.all(keep.reshape(-1, 8).sum(1) == 4)
    W_ref, keep_ref = sparsegpt_prune(W, H, sparsity, blocksize=24)
    assert torch.equal(keep, keep_ref) and torch.equal(W_new, W_ref)


def test_deterministic_and_dtype_preserved():
    W, _, H = problem()
    first = sparsegpt_prune(W, H, PATTERNS["2:4"], blocksize=40)
    second = sparsegpt_prune(W, H, PATTERNS["2:4"], blocksize=40)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    W_bf16 = W.to(torch.bfloat16)
    W_new, keep = sparsegpt_prune(W_bf16, H.double(), PATTERNS["50%"])
    assert W_new.dtype == torch.bfloat16 and torch.equal(W_new != 0, keep)
    assert torch.equal(W_bf16, W.to(torch.bfloat16))  # the input is not modified


def test_bad_inputs_raise_config_error():
    W, _, H = problem()
    with pytest.raises(ConfigError, match="divisible"):
        sparsegpt_prune(W[:, :90], H[:90, :90], PATTERNS["4:8"])
    with pytest.raises(ConfigError, match="Hessian shape"):
        sparsegpt_prune(W, H[:64, :64], PATTERNS["50%"])
    with pytest.raises(ConfigError):
        sparsegpt_prune(W[0], H, PATTERNS["50%"])
    with pytest.raises(ConfigError):
        sparsegpt_prune(W, H, PATTERNS["50%"], blocksize=0)
    with pytest.raises(ConfigError):
        sparsegpt_prune(W, H, Sparsity(n=4, m=4))


def test_indefinite_hessian_retries_with_more_dampening(caplog):
    W, _, _ = problem()
    H = torch.eye(IN)
    H[3, 3] = -0.05  # λ = 0.01 · mean(diag) ≈ 0.01 is too small, 0.1 is enough
    with caplog.at_level(logging.WARNING):
        W_new, keep = sparsegpt_prune(W, H, PATTERNS["2:4"])
    assert "retrying" in caplog.text
    assert torch.isfinite(W_new).all() and torch.all(keep.reshape(-1, 4).sum(1) == 2)
    H[3, 3] = -1e6  # no dampening the solver will try rescues this
    with pytest.raises(LmcompressError, match="singular"):
        sparsegpt_prune(W, H, PATTERNS["2:4"])
    H[3, 3] = float("nan")
    with pytest.raises(LmcompressError, match="NaN"):
        sparsegpt_prune(W, H, PATTERNS["2:4"])


def test_singular_hessian_without_dampening_retries_at_the_default():
    """percdamp 0 on a singular (rank-deficient, PSD) Hessian: the first retry uses 0.01 (ten
    times 0 is still 0), so the factor is that of H + 0.01 · mean(diag H) · I."""
    _, X, _ = problem()
    X = X.double()
    # an input that is always 0: a zero pivot, which every LAPACK refuses (two identical inputs
    # are singular only up to rounding: an AMD EPYC's factored them, and no retry came)
    X[:, 5] = 0
    H = X.T @ X
    U = inverse_hessian_factor(H, percdamp=0.0)
    Hd = H + 0.01 * H.diagonal().mean() * torch.eye(IN, dtype=H.dtype)
    torch.testing.assert_close(U.T @ U, torch.linalg.inv(Hd), rtol=1e-6, atol=1e-9)


def test_reconstruction_error_closed_forms():
    W, X, _ = problem()
    assert reconstruction_error(W, W, X) == 0.0
    assert reconstruction_error(W, torch.zeros_like(W), X) == pytest.approx(1.0)
    assert reconstruction_error(W, 1.5 * W, X.reshape(4, -1, IN)) == pytest.approx(0.5)


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_fixed_mask_reproduces_its_own_selection(pattern):
    """Given SparseGPT's own mask, the fixed-mask mode re-fits to the same weights."""
    sparsity = PATTERNS[pattern]
    W, _, H = problem()
    W_new, keep = sparsegpt_prune(W, H, sparsity)
    W_fixed, keep_fixed = sparsegpt_prune(W, H, sparsity, mask=keep)
    assert torch.equal(keep_fixed, keep)
    torch.testing.assert_close(W_fixed, W_new, rtol=1e-5, atol=1e-5)


def test_fixed_mask_refit_beats_masking_alone():
    """Re-fitting the kept weights of any fixed N:M mask lowers the output error, and the
    result keeps exactly that mask."""
    sparsity = Sparsity(n=2, m=4)
    W, X, H = problem()
    scores = torch.rand(W.shape, generator=torch.Generator().manual_seed(5))
    keep = mask_from_scores(scores, sparsity)
    W_refit, keep_refit = sparsegpt_prune(W, H, sparsity, mask=keep)
    assert torch.equal(keep_refit, keep) and torch.all(W_refit[~keep] == 0)
    masked = reconstruction_error(W, W * keep, X)
    refit = reconstruction_error(W, W_refit, X)
    assert refit < 0.95 * masked, (refit, masked)


def test_fixed_mask_shape_is_checked():
    W, _, H = problem()
    with pytest.raises(ConfigError, match="mask shape"):
        sparsegpt_prune(W, H, Sparsity(n=2, m=4), mask=torch.ones(3, 4, dtype=torch.bool))
