"""The linear algebra of the low-rank family, checked against direct solves on small float64
matrices: weighted truncation (weighted.py), the nearest Kronecker product (kronecker.py), the
regularised Cholesky factor, and the greedy rank allocation (ranks.py)."""

import math

import pytest
import torch

from lmcompress.errors import ConfigError
from lmcompress.methods.svd.kronecker import kronecker_residual, nearest_kronecker
from lmcompress.methods.svd.ranks import allocate_ranks, dense_rank
from lmcompress.methods.svd.weighted import (
    guard_diagonal,
    regularised_cholesky,
    weighted_error,
    weighted_factors,
    weighted_spectrum,
)

M, N = 7, 5  # out, in of the test weight


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _spd(size: int, seed: int) -> torch.Tensor:
    """A well-conditioned random SPD matrix (float64)."""
    P = torch.randn(size, size, dtype=torch.float64, generator=_gen(seed))
    return P @ P.T / size + 0.5 * torch.eye(size, dtype=torch.float64)


def _weight(kind: str, size: int, seed: int) -> torch.Tensor | None:
    if kind == "none":
        return None
    if kind == "diag":
        return torch.rand(size, dtype=torch.float64, generator=_gen(seed)) + 0.2
    return torch.linalg.cholesky(_spd(size, seed))  # lower triangular


def _as_matrix(weight: torch.Tensor | None, size: int) -> torch.Tensor:
    if weight is None:
        return torch.eye(size, dtype=torch.float64)
    return torch.diag(weight) if weight.dim() == 1 else weight


def _vec(A: torch.Tensor) -> torch.Tensor:
    """Column-major vec."""
    return A.T.reshape(-1)


def _unvec(v: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return v.reshape(cols, rows).T.contiguous()


def _kron(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.kron by broadcasting (torch.kron rejects some strided views, e.g. a (5, 1) Aᵀ)."""
    return (a[:, None, :, None] * b[None, :, None, :]).reshape(a.shape[0] * b.shape[0], -1)


def _als(W: torch.Tensor, F: torch.Tensor, rank: int, seed: int, iters: int = 3000):
    """Alternating least squares for min_{B, A} vec(W − BA)ᵀ F vec(W − BA) with the full
    (mn × mn) weight F, from random factors: each half step is the exact minimiser over one
    factor (a weighted least-squares problem), so the objective never increases."""
    m, n = W.shape
    g = _gen(seed)
    A = torch.randn(rank, n, dtype=torch.float64, generator=g)
    B = torch.randn(m, rank, dtype=torch.float64, generator=g)
    w = _vec(W)
    eye_m, eye_n = torch.eye(m, dtype=W.dtype), torch.eye(n, dtype=W.dtype)

    def solve(design: torch.Tensor) -> torch.Tensor:  # argmin_x (w − Dx)ᵀ F (w − Dx)
        return torch.linalg.solve(design.T @ F @ design, design.T @ F @ w)

    def objective() -> float:
        r = w - _vec(B @ A)
        return float(r @ F @ r)

    last = objective()
    for _ in range(iters):
        B = _unvec(solve(_kron(A.T, eye_m)), m, rank)  # vec(BA) = (Aᵀ ⊗ I_m) vec(B)
        A = _unvec(solve(_kron(eye_n, B)), rank, n)  # vec(BA) = (I_n ⊗ B) vec(A)
        now = objective()
        if last - now <= 1e-15 * last:
            break
        last = now
    return objective()


KINDS = ["none", "diag", "tri"]


@pytest.mark.parametrize("left_kind", KINDS)
@pytest.mark.parametrize("right_kind", KINDS)
def test_full_rank_reconstructs_the_weight(right_kind, left_kind):
    W = torch.randn(M, N, dtype=torch.float64, generator=_gen(1))
    right, left = _weight(right_kind, N, 2), _weight(left_kind, M, 3)
    A, B = weighted_factors(W, min(M, N), right, left)
    assert A.shape == (N, N) and B.shape == (M, N) and A.dtype == B.dtype == torch.float64
    torch.testing.assert_close(B @ A, W, rtol=1e-10, atol=1e-10)
    assert weighted_error(W, B @ A, right, left) < 1e-20 * float(W.square().sum())


@pytest.mark.parametrize(
    ("right_kind", "left_kind"),
    [("diag", "none"), ("tri", "none"), ("none", "tri"), ("diag", "diag"), ("tri", "tri"),
     ("tri", "diag")],
)  # fmt: skip
@pytest.mark.parametrize("rank", [1, 3])
def test_weighted_truncation_is_the_optimum(right_kind, left_kind, rank):
    W = torch.randn(M, N, dtype=torch.float64, generator=_gen(4))
    right, left = _weight(right_kind, N, 5), _weight(left_kind, M, 6)
    A, B = weighted_factors(W, rank, right, left)
    assert A.shape == (rank, N) and B.shape == (M, rank)
    assert torch.linalg.matrix_rank(B @ A) == rank
    ours = weighted_error(W, B @ A, right, left)

    # Eckart-Young in the weighted space: the dropped singular values of Lᵀ W R
    s = weighted_spectrum(W, right, left)
    R, L = _as_matrix(right, N), _as_matrix(left, M)
    assert torch.allclose(s, torch.linalg.svdvals(L.T @ W @ R), rtol=1e-12)
    assert ours == pytest.approx(float(s[rank:].square().sum()), rel=1e-10)

    # ‖Lᵀ ΔW R‖² = vec(ΔW)ᵀ (R Rᵀ ⊗ L Lᵀ) vec(ΔW), minimised directly by ALS from random factors
    F = torch.kron(R @ R.T, L @ L.T)
    delta = W - B @ A
    assert float(_vec(delta) @ F @ _vec(delta)) == pytest.approx(ours, rel=1e-10)
    best = min(_als(W, F, rank, seed) for seed in (7, 8))
    assert ours <= best * (1 + 1e-8)
    assert best <= ours * (1 + 1e-6)


@pytest.mark.parametrize("rank", [1, 2, 4])
def test_svd_llm_whitening_matches_the_direct_optimum(rank):
    """With R = chol(X Xᵀ), ‖(W − W')R‖ = ‖(W − W')X‖: the weighted truncation equals the
    direct minimiser of the output error, W' = [W X]_r X⁺."""
    m, n, t = 6, 5, 40
    g = _gen(9)
    W = torch.randn(m, n, dtype=torch.float64, generator=g)
    X = torch.randn(n, t, dtype=torch.float64, generator=g) * torch.linspace(0.1, 3, n)[:, None]
    R, alpha = regularised_cholesky(X @ X.T)
    assert alpha == 0.0
    A, B = weighted_factors(W, rank, right=R)
    ours = float(((W - B @ A) @ X).square().sum())

    U, S, Vh = torch.linalg.svd(W @ X, full_matrices=False)
    direct = (U[:, :rank] * S[:rank]) @ Vh[:rank] @ torch.linalg.pinv(X)
    optimum = float(((W - direct) @ X).square().sum())
    assert ours == pytest.approx(optimum, rel=1e-8)
    assert ours == pytest.approx(float(S[rank:].square().sum()), rel=1e-8)
    assert ours == pytest.approx(weighted_error(W, B @ A, right=R), rel=1e-8)


# --- the nearest Kronecker product ----------------------------------------------------------


def _sym_sqrt(S: torch.Tensor) -> torch.Tensor:
    values, vectors = torch.linalg.eigh(S)
    return vectors @ torch.diag(values.sqrt()) @ vectors.T


@pytest.mark.parametrize("init", ["identity", "random"])
def test_nearest_kronecker_recovers_a_kronecker_fisher(init):
    m, n = 4, 3
    X, Y = _spd(n, 10), _spd(m, 11)
    x_cols, y_cols = _sym_sqrt(X), _sym_sqrt(Y)  # Σ_j x_j x_jᵀ = X, Σ_i y_i y_iᵀ = Y
    grads = torch.stack(
        [torch.outer(y_cols[:, i], x_cols[:, j]) for i in range(m) for j in range(n)]
    )  # (K = mn, m, n): vec(y xᵀ) = x ⊗ y, so (1/K) Σ vec vecᵀ = X ⊗ Y / K
    start = None if init == "identity" else _spd(n, 12)
    X_hat, Y_hat, used = nearest_kronecker(grads, init=start)
    assert X_hat.shape == (n, n) and Y_hat.shape == (m, m) and 1 <= used <= 10
    expected = torch.kron(X, Y) / grads.shape[0]
    got = torch.kron(X_hat, Y_hat)
    assert float((got - expected).norm() / expected.norm()) < 1e-8
    assert kronecker_residual(grads, X_hat, Y_hat) < 1e-8
    assert torch.equal(X_hat, X_hat.T) and torch.equal(Y_hat, Y_hat.T)
    assert torch.trace(X_hat) > 0 and torch.trace(Y_hat) > 0


def _kfac_samples(K: int, T: int, m: int, n: int, seed: int):
    """Per-sample gradients G_k = Σ_t δ_t x_tᵀ and the K-FAC factors Σ x xᵀ, Σ δ δᵀ."""
    g = _gen(seed)
    xs = torch.randn(K, n, T, dtype=torch.float64, generator=g)  # inputs
    ds = torch.randn(K, m, T, dtype=torch.float64, generator=g)  # output gradients
    xs = xs * torch.linspace(0.2, 2.0, n, dtype=torch.float64)[None, :, None]
    grads = ds @ xs.transpose(1, 2)  # (K, m, n)
    kfac_x = torch.einsum("kit,kjt->ij", xs, xs)
    kfac_y = torch.einsum("kit,kjt->ij", ds, ds)
    return grads, kfac_x, kfac_y


def _best_scaled_residual(grads: torch.Tensor, X: torch.Tensor, Y: torch.Tensor) -> float:
    """The residual of c·(X ⊗ Y) with the least-squares scale c (formed densely)."""
    K, m, n = grads.shape
    vecs = grads.transpose(1, 2).reshape(K, m * n)
    F = vecs.T @ vecs / K
    P = torch.kron(X, Y)
    c = float((F * P).sum() / P.square().sum())
    return kronecker_residual(grads, c * X, Y)


@pytest.mark.parametrize("use_kfac_init", [False, True])
def test_nearest_kronecker_is_no_worse_than_kfac(use_kfac_init):
    grads, kfac_x, kfac_y = _kfac_samples(K=6, T=3, m=4, n=5, seed=13)
    kfac = _best_scaled_residual(grads, kfac_x, kfac_y)
    assert 0.05 < kfac < 1  # generic gradients: not a Kronecker product
    if use_kfac_init:  # as GFWSVD runs it: each half step can only lower the residual
        X, Y, _ = nearest_kronecker(grads, init=kfac_x)
    else:
        X, Y, _ = nearest_kronecker(grads, iters=200, tol=1e-12)
    ours = kronecker_residual(grads, X, Y)
    assert ours <= kfac + 1e-12
    # and it is the optimum: the least-squares scale of its own product changes nothing
    assert _best_scaled_residual(grads, X, Y) == pytest.approx(ours, rel=1e-9)
    assert torch.equal(X, X.T) and torch.equal(Y, Y.T)
    assert torch.trace(X) > 0 and torch.trace(Y) > 0


def test_nearest_kronecker_bad_inputs():
    with pytest.raises(ConfigError, match="gradients"):
        nearest_kronecker(torch.zeros(3, 4))
    with pytest.raises(ConfigError, match="no gradient samples"):
        nearest_kronecker([])
    with pytest.raises(ConfigError, match="init"):
        nearest_kronecker(torch.zeros(2, 4, 3), init=torch.eye(4))


# --- regularisation -------------------------------------------------------------------------


def test_regularised_cholesky_fixes_an_indefinite_matrix():
    Q, _ = torch.linalg.qr(torch.randn(6, 6, dtype=torch.float64, generator=_gen(14)))
    values = torch.tensor([3.0, 2.0, 1.0, 0.5, 0.1, -0.05], dtype=torch.float64)
    F = Q @ torch.diag(values) @ Q.T
    assert torch.linalg.cholesky_ex(F).info != 0
    L, alpha = regularised_cholesky(F)
    assert 0 < alpha <= 1
    assert torch.equal(L, L.tril()) and (L.diagonal() > 0).all()
    target = (1 - alpha) * F + alpha * F.diagonal().mean() * torch.eye(6, dtype=F.dtype)
    torch.testing.assert_close(L @ L.T, target, rtol=1e-10, atol=1e-10)
    # the smallest α of the ×10 ladder that works: the one before it must fail
    before = alpha / 10
    previous = (1 - before) * F + before * F.diagonal().mean() * torch.eye(6, dtype=F.dtype)
    assert torch.linalg.cholesky_ex(previous).info != 0


def test_regularised_cholesky_leaves_an_spd_matrix_alone():
    F = _spd(5, 15)
    L, alpha = regularised_cholesky(F)
    assert alpha == 0.0
    torch.testing.assert_close(L, torch.linalg.cholesky(F), rtol=0, atol=1e-14)
    L, alpha = regularised_cholesky(F, 0.1)  # a requested α is used as is
    assert alpha == 0.1
    target = 0.9 * F + 0.1 * F.diagonal().mean() * torch.eye(5, dtype=F.dtype)
    torch.testing.assert_close(L @ L.T, target, rtol=1e-12, atol=1e-12)


def test_regularised_cholesky_of_zero_is_the_identity():
    L, alpha = regularised_cholesky(torch.zeros(4, 4, dtype=torch.float64))
    assert torch.equal(L, torch.eye(4, dtype=torch.float64)) and alpha == 1.0


def test_regularised_cholesky_bad_inputs():
    with pytest.raises(ConfigError, match="square"):
        regularised_cholesky(torch.zeros(3, 4))
    with pytest.raises(ConfigError, match="alpha"):
        regularised_cholesky(torch.eye(3), 1.5)
    with pytest.raises(ConfigError, match="nan"):
        regularised_cholesky(torch.full((2, 2), float("nan")))


def test_guard_diagonal():
    d = torch.tensor([0.0, 1.0, 4.0, 0.0, 1e-9], dtype=torch.float64)
    guarded = guard_diagonal(d)
    assert torch.equal(guarded, torch.tensor([4e-6, 1.0, 4.0, 4e-6, 4e-6], dtype=torch.float64))
    assert torch.equal(guard_diagonal(torch.zeros(3)), torch.ones(3))
    with pytest.raises(ConfigError, match="non-negative"):
        guard_diagonal(torch.tensor([1.0, -1.0]))
    with pytest.raises(ConfigError, match="positive"):
        weighted_factors(torch.eye(2), 1, right=torch.tensor([1.0, 0.0]))


# --- rank allocation ------------------------------------------------------------------------


def _kept(spectra, ranks) -> int:
    return sum(
        m * n if ranks[k] is None else ranks[k] * (m + n) for k, (m, n, _) in spectra.items()
    )


def _spectrum(size: int, decay: float, scale: float = 1.0) -> torch.Tensor:
    return scale * torch.exp(-decay * torch.arange(size, dtype=torch.float64))


@pytest.mark.parametrize("ratio", [0.3, 0.5, 0.8])
@pytest.mark.parametrize("relative", [True, False])
def test_allocate_ranks_fills_the_budget(ratio, relative):
    spectra = {
        "a": (64, 64, _spectrum(64, 0.02)),
        "b": (128, 64, _spectrum(64, 0.1, 3.0)),
        "c": (64, 192, _spectrum(64, 0.01, 0.5)),
        "d": (96, 96, torch.rand(96, dtype=torch.float64, generator=_gen(16)).sort()[0].flip(0)),
    }
    ranks = allocate_ranks(spectra, ratio, relative=relative)
    assert set(ranks) == set(spectra)
    assert all(r is None or (r % 8 == 0 and 0 < r < dense_rank(m, n))
               for (m, n, _), r in zip(spectra.values(), ranks.values(), strict=True))  # fmt: skip
    budget = ratio * sum(m * n for m, n, _ in spectra.values())
    step = max(8 * (m + n) for m, n, _ in spectra.values())
    assert budget - step < _kept(spectra, ranks) <= budget


def test_allocate_ranks_favours_the_flatter_spectrum():
    spectra = {"steep": (128, 128, _spectrum(128, 0.3)), "flat": (128, 128, _spectrum(128, 0.01))}
    ranks = allocate_ranks(spectra, 0.5)
    assert ranks["flat"] is None or ranks["flat"] > ranks["steep"] + 8, ranks


def test_allocate_ranks_relative_versus_absolute():
    """Two layers with the same spectrum up to a factor 30: relative errors ignore the scale,
    absolute errors send the rank to the larger layer."""
    spectra = {
        "small": (128, 128, _spectrum(128, 0.03)),
        "large": (128, 128, _spectrum(128, 0.03, 30.0)),
    }
    relative = allocate_ranks(spectra, 0.5, relative=True)
    absolute = allocate_ranks(spectra, 0.5, relative=False)
    assert abs(relative["small"] - relative["large"]) <= 8, relative
    assert absolute["large"] is None or absolute["large"] > absolute["small"] + 8, absolute
    assert relative != absolute


def test_allocate_ranks_ratio_one_keeps_everything_dense():
    spectra = {"a": (64, 64, _spectrum(64, 0.1)), "b": (32, 64, _spectrum(32, 0.1))}
    assert allocate_ranks(spectra, 1.0) == {"a": None, "b": None}


def test_allocate_ranks_below_the_minimum_warns(caplog):
    spectra = {"a": (64, 64, _spectrum(64, 0.1))}
    with caplog.at_level("WARNING", logger="lmcompress.methods.svd.ranks"):
        ranks = allocate_ranks(spectra, 0.05)  # rank 8 alone keeps 8·128 / 4096 = 25 %
    assert ranks == {"a": 8}
    assert any("ratio" in r.getMessage() for r in caplog.records)
    assert math.isclose(_kept(spectra, ranks) / 4096, 0.25)
