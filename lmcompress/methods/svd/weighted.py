"""Weighted truncated SVD: the one piece of linear algebra behind every low-rank method here.

Each method minimises a weighted error of the layer's weight ``W`` (out m, in n) over rank-r
replacements ``W'``::

    ‖ Lᵀ (W − W') R ‖_F²

with an input-side weight ``R`` (n × n) and an output-side weight ``L`` (m × m), each either
``None`` (identity), a vector (a diagonal) or a lower-triangular matrix (a Cholesky factor):

========  =========================================  ======================================
method    R (input side)                             L (output side)
========  =========================================  ======================================
svd       identity                                   identity
asvd      diag(mean|x_j|^α)                          identity
svd-llm   chol(Σ x xᵀ): ‖(W−W')X‖² = ‖(W−W')R‖²     identity
fwsvd     diag(√I_j), I_j = Σ_i Fisher_ij            identity
gfwsvd    chol(X) (input Kronecker factor)           chol(Y) (output Kronecker factor)
========  =========================================  ======================================

For Fisher ≈ X ⊗ Y the quadratic form vec(ΔW)ᵀ (X ⊗ Y) vec(ΔW) = tr(ΔWᵀ Y ΔW X) =
‖L_Yᵀ ΔW L_X‖², so the Kronecker case is the same problem. With both weights invertible the
optimum is closed form (Eckart–Young in the weighted space): W̃ = Lᵀ W R = U S Vᵀ, keep the top
r triplets, map back: ``A = √S_r V_rᵀ R⁻¹`` (r, n), ``B = L⁻ᵀ U_r √S_r`` (m, r), W' = B A. The
weighted error of rank r is Σ_{i>r} s_i², which :mod:`ranks` uses to allocate ranks.

All functions are pure (tensors in, tensors out) and compute in float64 for float64 inputs,
float32 otherwise.
"""

from __future__ import annotations

import logging

import torch

from lmcompress.errors import ConfigError

logger = logging.getLogger(__name__)

Weight = torch.Tensor | None  # None: identity; 1-D: a diagonal; 2-D: lower triangular

# A diagonal weight below this fraction of its largest entry is raised to it: a feature that
# never fired (or has zero Fisher) would otherwise make R⁻¹ infinite (FWSVD's "guard zeros").
DIAGONAL_FLOOR = 1e-6


def _compute_dtype(W: torch.Tensor) -> torch.dtype:
    return torch.float64 if W.dtype == torch.float64 else torch.float32


def guard_diagonal(d: torch.Tensor, floor: float = DIAGONAL_FLOOR) -> torch.Tensor:
    """A strictly positive copy of the non-negative diagonal weight ``d``: entries below
    ``floor · max(d)`` are raised to it (all-zero ``d``: ones, i.e. no weighting)."""
    if not torch.isfinite(d).all() or (d < 0).any():
        raise ConfigError("a diagonal weight must be finite and non-negative")
    top = d.max()
    if top <= 0:
        return torch.ones_like(d)
    return d.clamp_min(top * floor)


def regularised_cholesky(
    F: torch.Tensor, alpha: float = 0.0, *, max_tries: int = 12
) -> tuple[torch.Tensor, float]:
    """The lower Cholesky factor of ``(1 − α) F + α · mean(diag F) · I`` for the smallest α in
    ``alpha, then ×10 each try (starting at 1e-8 when alpha is 0)`` at which it exists, and
    that α.

    ``F`` is a symmetric positive semi-definite estimate (a Gram matrix, a Kronecker factor)
    that may be singular or, from round-off or a power iteration, slightly indefinite. The
    shrinkage towards ``mean(diag F)·I`` keeps the scale of ``F``; α = 1 is the identity times
    that mean, always factorisable. An all-zero ``F`` gives the identity.
    """
    if F.dim() != 2 or F.shape[0] != F.shape[1]:
        raise ConfigError(f"expected a square matrix, got shape {tuple(F.shape)}")
    if not 0.0 <= alpha <= 1.0:
        raise ConfigError(f"regularisation alpha must lie in [0, 1], got {alpha}")
    if not torch.isfinite(F).all():
        raise ConfigError("cannot regularise a matrix with inf or nan entries")
    compute = _compute_dtype(F)
    F = F.to(compute)
    F = (F + F.T) / 2
    scale = F.diagonal().mean()
    eye = torch.eye(F.shape[0], dtype=compute, device=F.device)
    if scale <= 0:
        return eye, 1.0
    for _ in range(max_tries):
        L, info = torch.linalg.cholesky_ex((1.0 - alpha) * F + alpha * scale * eye)
        if int(info) == 0:
            return L, alpha
        alpha = min(1.0, max(alpha * 10.0, 1e-8))
    L = torch.linalg.cholesky(scale * eye)  # alpha = 1
    return L, 1.0


def _apply_right(M: torch.Tensor, R: Weight) -> torch.Tensor:
    """``M @ R`` for R identity / diagonal / matrix."""
    if R is None:
        return M
    return M * R[None, :] if R.dim() == 1 else M @ R


def _apply_left_t(L: Weight, M: torch.Tensor) -> torch.Tensor:
    """``Lᵀ @ M``."""
    if L is None:
        return M
    return L[:, None] * M if L.dim() == 1 else L.T @ M


def _check_weight(weight: Weight, size: int, side: str) -> Weight:
    if weight is None:
        return None
    if weight.dim() == 1:
        if weight.shape[0] != size:
            raise ConfigError(f"{side} diagonal has {weight.shape[0]} entries, expected {size}")
        if not torch.isfinite(weight).all() or (weight <= 0).any():
            raise ConfigError(f"{side} diagonal must be finite and positive (guard_diagonal)")
        return weight
    if weight.shape != (size, size):
        raise ConfigError(f"{side} weight has shape {tuple(weight.shape)}, expected {size}x{size}")
    return weight


def weighted_matrix(W: torch.Tensor, right: Weight = None, left: Weight = None) -> torch.Tensor:
    """``W̃ = Lᵀ W R`` in the compute dtype: the matrix whose truncated SVD is the optimum."""
    m, n = W.shape
    compute = _compute_dtype(W)
    right = _check_weight(right, n, "input-side")
    left = _check_weight(left, m, "output-side")
    cast = lambda t: None if t is None else t.to(compute)  # noqa: E731
    return _apply_left_t(cast(left), _apply_right(W.to(compute), cast(right)))


def weighted_spectrum(W: torch.Tensor, right: Weight = None, left: Weight = None) -> torch.Tensor:
    """Singular values of ``W̃`` (descending): truncating at rank r costs Σ_{i>r} s_i² in the
    weighted norm."""
    return torch.linalg.svdvals(weighted_matrix(W, right, left))


@torch.no_grad()
def weighted_factors(
    W: torch.Tensor, rank: int, right: Weight = None, left: Weight = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rank-``rank`` minimiser of ``‖Lᵀ (W − B A) R‖_F`` as factors ``A`` (rank, in) and
    ``B`` (out, rank), in ``W``'s dtype. √S goes to both sides, as in plain truncated SVD."""
    m, n = W.shape
    if not 1 <= rank <= min(m, n):
        raise ConfigError(
            f"rank {rank} is impossible for a {m}x{n} weight (need 1 <= rank <= {min(m, n)})"
        )
    compute = _compute_dtype(W)
    U, S, Vh = torch.linalg.svd(weighted_matrix(W, right, left), full_matrices=False)
    root = S[:rank].sqrt()
    A = root[:, None] * Vh[:rank]  # (r, n) = √S Vᵀ, still times R
    B = U[:, :rank] * root[None, :]  # (m, r) = U √S, still times Lᵀ
    if right is not None:
        right = right.to(compute)
        if right.dim() == 1:
            A = A / right[None, :]
        else:  # A R = √S Vᵀ  ->  A = √S Vᵀ R⁻¹
            A = torch.linalg.solve_triangular(right, A, upper=False, left=False)
    if left is not None:
        left = left.to(compute)
        if left.dim() == 1:
            B = B / left[:, None]
        else:  # Lᵀ B = U √S  ->  B = L⁻ᵀ U √S
            B = torch.linalg.solve_triangular(left.T, B, upper=True)
    return A.to(W.dtype).contiguous(), B.to(W.dtype).contiguous()


def weighted_error(
    W: torch.Tensor, W_new: torch.Tensor, right: Weight = None, left: Weight = None
) -> float:
    """``‖Lᵀ (W − W_new) R‖_F²``: the objective every factorisation here minimises."""
    return float(weighted_matrix(W - W_new, right, left).square().sum())
