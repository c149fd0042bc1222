"""MaskLLM (Fang et al., NeurIPS 2024, arXiv 2409.17481): the math of learnable N:M masks.

Every group of ``m`` consecutive input weights of an ``(out, in)`` weight owns one logit per
candidate pattern (all ``C(m, n)`` binary vectors with ``n`` ones; 6 for 2:4). Training uses a
soft mask, a Gumbel-softmax-weighted average of the candidates::

    mask = softmax((κ · logits + g) / τ) @ candidates,   g ~ Gumbel(0, 1)        (Eq. 4-5)

so every group's mask sums to exactly ``n``; inference takes the argmax candidate, an exact
N:M mask. A one-shot mask ``M0`` is a prior (Sec. 3.3)::

    logits += α · std(logits) · (overlap(candidate, M0 group) − n / 2)
"""

from __future__ import annotations

import itertools

import torch


def candidate_patterns(n: int, m: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """All ``C(m, n)`` patterns with ``n`` ones among ``m``, as rows: (C, m)."""
    rows = [
        [1 if j in kept else 0 for j in range(m)] for kept in itertools.combinations(range(m), n)
    ]
    return torch.tensor(rows, dtype=dtype)


def init_logits(
    groups: int, candidates: int, std: float = 0.01, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Logits (groups, C) drawn from N(0, std²), the paper's initialisation."""
    return torch.randn(groups, candidates, generator=generator) * std


def prior_logits(
    logits: torch.Tensor,
    prior_keep: torch.Tensor,
    candidates: torch.Tensor,
    strength: float = 3.0,
    exact: bool = True,
) -> torch.Tensor:
    """Shift ``logits`` (G, C) towards the candidates that agree with ``prior_keep`` (G, m).

    With ``exact``, groups whose argmax would not be the prior's best candidate (the init noise
    is as large as the prior's margin: ~5 % of groups for α = 3) get that candidate's logit raised
    to the group's maximum plus half the margin, so the step-0 hard mask *is* the prior.
    """
    n = candidates[0].sum()
    overlap = prior_keep.to(candidates.dtype) @ candidates.T  # (G, C): shared ones, 0..n
    margin = strength * logits.std()
    shifted = logits + margin * (overlap - n / 2)
    if exact:
        best = overlap.argmax(dim=1)  # (G,) the candidate closest to the prior group
        best_logit = shifted.gather(1, best[:, None])  # (G, 1)
        others = shifted.scatter(1, best[:, None], float("-inf")).amax(1, keepdim=True)
        raised = torch.where(best_logit > others, best_logit, others + margin / 2)
        shifted = shifted.scatter(1, best[:, None], raised)
    return shifted


def gumbel_noise(shape: torch.Size | tuple[int, ...], generator=None, device=None) -> torch.Tensor:
    """Standard Gumbel samples ``−log(−log U)``, U ~ Uniform(0, 1)."""
    u = torch.rand(shape, generator=generator, device=device).clamp_(1e-10, 1.0 - 1e-7)
    return -torch.log(-torch.log(u))


def soft_mask(
    logits: torch.Tensor,
    candidates: torch.Tensor,
    tau: float,
    kappa: float,
    noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """Differentiable mask (G, m): ``softmax((κ·logits + noise) / τ) @ candidates``."""
    scores = logits * kappa if noise is None else logits * kappa + noise
    return torch.softmax(scores / tau, dim=-1) @ candidates  # (G, C) @ (C, m)


def hard_mask(logits: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """The argmax candidate of every group (G, m): exactly N:M."""
    return candidates[logits.argmax(dim=-1)]


def linear_schedule(start: float, end: float, step: int, total: int) -> float:
    """``start`` at step 0, ``end`` at step ``total``, linear in between (the paper's τ, κ)."""
    if total <= 0:
        return end
    return start + (end - start) * min(max(step / total, 0.0), 1.0)
