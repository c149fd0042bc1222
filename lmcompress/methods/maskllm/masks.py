"""MaskLLM (Fang et al., NeurIPS 2024, arXiv 2409.17481): the math of learnable N:M masks.

Every group of ``m`` consecutive input weights of an ``(out, in)`` weight owns one logit per
candidate pattern (all ``C(m, n)`` binary vectors with ``n`` ones; 6 for 2:4). Training uses a
soft mask, a Gumbel-softmax-weighted average of the candidates::

    mask = softmax((κ · logits + g) / τ) @ candidates,   g ~ Gumbel(0, 1)        (Eq. 4-5)

so every group's mask sums to exactly ``n``; inference takes the argmax candidate, an exact
N:M mask. A one-shot mask ``M0`` is a prior (Sec. 3.3)::

    logits += α · std(logits) · (overlap(candidate, M0 group) − n / 2)

Straight-through training (``soft_mask(..., hard=True)``) uses the sampled argmax pattern,
``onehot(argmax(κ · logits + g)) @ candidates``, in the forward pass and the soft mask's
gradient in the backward pass. The candidate patterns, the Gumbel noise sources and the
schedules are generic (subnetwork extraction uses them too):
:mod:`lmcompress.compressor.training.gumbel`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


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


def soft_mask(
    logits: torch.Tensor,
    candidates: torch.Tensor,
    tau: float,
    kappa: float,
    noise: torch.Tensor | None = None,
    *,
    hard: bool = False,
) -> torch.Tensor:
    """Differentiable mask (G, m): ``softmax((κ·logits + noise) / τ) @ candidates``.

    With ``hard``, straight-through: the forward value is the candidate at
    ``argmax(κ·logits + noise)`` (exactly N:M per group, the Gumbel-max sample), the gradient
    is the soft mask's. It is written ``hard + (soft − soft.detach())`` so that the forward
    value is exactly 0/1 (``x − x = 0`` in floating point).
    """
    scores = logits * kappa if noise is None else logits * kappa + noise
    soft = torch.softmax(scores / tau, dim=-1) @ candidates  # (G, C) @ (C, m)
    if not hard:
        return soft
    sampled = candidates[scores.detach().argmax(dim=-1)]  # (G, m)
    return sampled + (soft - soft.detach())


# Soft-mask entries below this are set to 0 in the forward value. At small τ the softmax gives
# values like e^-100, and W ⊙ mask then holds subnormal floats, which make every CPU GEMM with
# that weight ~90x slower (measured: a 512×576 @ 576×1536 matmul, 5 ms -> 0.46 s; flushing
# denormals with torch.set_flush_denormal did not help). In the paper's schedule this slowed the
# last 5 % of the steps of an end-to-end SmolLM2 run from 12 s to over 150 s. An entry below
# 1e-12 changes no float32 output of the layer; the backward still uses the exact softmax.
MASK_FLOOR = 1e-12


class _ReplayedSoftMask(torch.autograd.Function):
    """:func:`soft_mask` (optionally straight-through) that keeps no (G, C) tensor between
    forward and backward: the backward replays the noise and recomputes the softmax. Autograd
    would otherwise hold the probabilities of every layer until the backward pass (636 MB for
    SmolLM2-135M's 159M logits); the price is a second noise draw per step."""

    @staticmethod
    def forward(ctx, logits, candidates, tau, kappa, noise_fn, hard):  # noqa: ANN001
        # in the logits' dtype even under autocast (a bf16 ``@`` would round the mask, and the
        # backward below works in the logits' dtype)
        with torch.autocast(logits.device.type, enabled=False):
            scores = logits * kappa + noise_fn()  # (G, C)
            if hard:
                out = candidates[scores.argmax(dim=-1)]
            else:
                out = torch.softmax(scores.div_(tau), dim=-1) @ candidates
                out.masked_fill_(out < MASK_FLOOR, 0.0)  # no subnormal weights (see MASK_FLOOR)
        ctx.save_for_backward(logits, candidates)
        ctx.tau, ctx.kappa, ctx.noise_fn = tau, kappa, noise_fn
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001
        logits, candidates = ctx.saved_tensors
        grad = grad.to(logits.dtype)
        p = torch.softmax((logits * ctx.kappa + ctx.noise_fn()).div_(ctx.tau), dim=-1)  # (G, C)
        dp = grad @ candidates.T  # dL/dp, (G, C)
        # softmax Jacobian-vector product: p ⊙ (dp − <p, dp>), then d scores / d logits = κ/τ
        ds = p.mul_(dp - (p * dp).sum(dim=-1, keepdim=True)).mul_(ctx.kappa / ctx.tau)
        return ds, None, None, None, None, None


def soft_mask_replayed(
    logits: torch.Tensor,
    candidates: torch.Tensor,
    tau: float,
    kappa: float,
    noise_fn: Callable[[], torch.Tensor],
    hard: bool = False,
) -> torch.Tensor:
    """The same value and gradient as ``soft_mask(logits, candidates, tau, kappa, noise_fn(),
    hard=hard)``, with less memory held for backward (see ``_ReplayedSoftMask``)."""
    return _ReplayedSoftMask.apply(logits, candidates, tau, kappa, noise_fn, hard)


def hard_mask(logits: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """The argmax candidate of every group (G, m): exactly N:M."""
    return candidates[logits.argmax(dim=-1)]
