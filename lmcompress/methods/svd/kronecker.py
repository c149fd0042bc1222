"""Kronecker factors of a layer's Fisher: ``F ≈ X ⊗ Y`` with X (in × in), Y (out × out).

With per-sample weight gradients ``G_k`` (out m, in n) the empirical Fisher is
``F = (1/K) Σ_k vec(G_k) vec(G_k)ᵀ`` (column-major vec, an mn × mn matrix nobody can store).
Two ways to a Kronecker product:

- **K-FAC** (what the core's gradient pass accumulates): ``G = Σ_t δ_t x_tᵀ`` and the
  approximation E[x xᵀ] ⊗ E[δ δᵀ], i.e. ``X = Σ x xᵀ``, ``Y = Σ δ δᵀ`` up to scale. Cheap,
  but assumes inputs and output gradients independent.
- **Nearest Kronecker product** (GFWSVD, Chekalina et al.; Van Loan–Pitsianis): the X ⊗ Y
  closest to F in Frobenius norm. Rearranging F so that X ⊗ Y becomes the rank-one
  ``vec(X) vec(Y)ᵀ`` makes it the top singular pair of the rearranged Fisher, found here by
  alternating power iteration without ever forming F::

      Y ← (1/K) Σ_k G_k X G_kᵀ        X ← (1/K) Σ_k G_kᵀ Y G_k

  (each is the exact minimiser over one factor with the other fixed, up to scale).
  ``vec(ΔW)ᵀ (X ⊗ Y) vec(ΔW) = tr(ΔWᵀ Y ΔW X)`` is the weighted error that GFWSVD truncates.

When F is an SPD Kronecker product the iteration recovers it exactly; X and Y of an SPD F can
be taken symmetric positive semi-definite (Van Loan & Pitsianis 1993), and are regularised
before their Cholesky factors are used (:func:`weighted.regularised_cholesky`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from lmcompress.errors import ConfigError

logger = logging.getLogger(__name__)


def _output_step(grads: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """(1/K) Σ_k G_k X G_kᵀ, (m, m), for grads (K, m, n)."""
    return torch.einsum("kij,kjl->il", grads @ X, grads.transpose(1, 2)) / grads.shape[0]


def _input_step(grads: torch.Tensor, Y: torch.Tensor) -> torch.Tensor:
    """(1/K) Σ_k G_kᵀ Y G_k, (n, n)."""
    return torch.einsum("kji,kjl->il", grads, Y @ grads) / grads.shape[0]


def _stack(grads: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    if not isinstance(grads, torch.Tensor):
        if not grads:
            raise ConfigError("nearest Kronecker product: no gradient samples")
        grads = torch.stack(list(grads))
    if grads.dim() != 3 or grads.shape[0] == 0:
        raise ConfigError(f"expected gradients of shape (K, out, in), got {tuple(grads.shape)}")
    compute = torch.float64 if grads.dtype == torch.float64 else torch.float32
    return grads.to(compute)


@torch.no_grad()
def nearest_kronecker(
    grads: torch.Tensor | Sequence[torch.Tensor],
    *,
    init: torch.Tensor | None = None,
    iters: int = 10,
    tol: float = 1e-4,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The Kronecker product ``X ⊗ Y`` nearest (Frobenius) to the empirical Fisher of the
    per-sample gradients ``grads`` (K, out m, in n): returns ``X`` (n, n), ``Y`` (m, m) and the
    iterations used.

    ``init``: a starting X (the K-FAC input factor is a good one; default identity). Stops when
    the normalised X moves less than ``tol`` (Frobenius) in an iteration, or after ``iters``.
    Both factors come back symmetric with positive trace; their product carries the scale of F
    (X has unit Frobenius norm, Y the singular value).
    """
    G = _stack(grads)
    _, m, n = G.shape
    if iters < 1:
        raise ConfigError(f"iters must be at least 1, got {iters}")
    X = torch.eye(n, dtype=G.dtype, device=G.device) if init is None else init.to(G)
    if X.shape != (n, n):
        raise ConfigError(f"init has shape {tuple(X.shape)}, expected ({n}, {n})")
    X = X / X.norm().clamp_min(1e-300)
    used = 0
    for used in range(1, iters + 1):  # noqa: B007 - the count is returned
        Y = _output_step(G, X)
        Y = Y / Y.norm().clamp_min(1e-300)
        X_new = _input_step(G, Y)
        X_new = X_new / X_new.norm().clamp_min(1e-300)
        moved = float((X_new - X).norm())
        X = X_new
        if moved < tol:
            break
    Y = _output_step(G, X)  # unnormalised: sigma · unit Y, so that X ⊗ Y approximates F
    X, Y = (X + X.T) / 2, (Y + Y.T) / 2
    if torch.trace(X) < 0:  # the pair is defined up to a common sign
        X, Y = -X, -Y
    return X, Y, used


def kronecker_residual(
    grads: torch.Tensor | Sequence[torch.Tensor], X: torch.Tensor, Y: torch.Tensor
) -> float:
    """``‖F − X ⊗ Y‖_F / ‖F‖_F`` for small problems (forms the mn × mn Fisher: tests only)."""
    G = _stack(grads)
    K, m, n = G.shape
    vecs = G.transpose(1, 2).reshape(K, m * n)  # column-major vec of each G_k
    F = vecs.T @ vecs / K
    approx = torch.kron(X.to(F).contiguous(), Y.to(F).contiguous())
    return float((F - approx).norm() / F.norm().clamp_min(1e-300))
