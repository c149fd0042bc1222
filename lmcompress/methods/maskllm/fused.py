"""The masked weight ``W ⊙ mask(logits)`` of a learnable N:M mask in one CPU pass per direction
(:mod:`lmcompress.kernels.soft_mask`), for noise "pool" and "counter".

The torch path (``masks.soft_mask_replayed`` then ``W * mask``) makes ~10 passes over (G, C)
and (G, m) tensors in each direction; on SmolLM2-135M's 159M logits that was 13 s of a ~25 s
end-to-end step at one thread (``benchmarks/results/learned.md`` has the step rates). The kernel
reads the logits and the weight once, draws the same noise as the torch path (the same pool
window, or ``gumbel.counter_gumbel``'s values for the same seed: one draw from the global RNG a
call in both), and keeps nothing between forward and backward but the noise's offset or seed.
Values agree with the torch path to float rounding (``expf`` against torch's ``exp``).
"""

from __future__ import annotations

import torch

from lmcompress.compressor.training.gumbel import shared_gumbel_pool
from lmcompress.kernels import soft_mask as kernel
from lmcompress.methods.maskllm.masks import MASK_FLOOR

FUSED_NOISES = ("pool", "counter")

NoiseSpec = tuple[torch.Tensor | None, int, int]  # (doubled pool, offset, seed)


def draw_noise(source: str) -> NoiseSpec:
    """The noise of one call, drawn from the global RNG as ``gumbel.replayable_noise`` does."""
    if source == "pool":
        pool = shared_gumbel_pool()
        offset = int(torch.randint(pool.size, ()))
        return pool.doubled(torch.device("cpu"), torch.float32), offset, 0
    if source == "counter":
        return None, 0, int(torch.randint(2**62, ()))
    raise ValueError(f"the fused mask takes noise {FUSED_NOISES}, got {source!r}")


def fused_supported(
    noise: str, logits: torch.Tensor, candidates: torch.Tensor, weight: torch.Tensor
) -> bool:
    """Whether :func:`masked_weight` runs for these (else the caller takes the torch path)."""
    return noise in FUSED_NOISES and kernel.soft_mask_supported(candidates, logits, weight)


class _MaskedWeight(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, weight, candidates, tau, kappa, noise, hard):  # noqa: ANN001
        m = candidates.shape[1]
        out = kernel.soft_mask_forward(
            logits.detach(), candidates, kappa, tau, noise, hard, MASK_FLOOR,
            weight.detach().reshape(-1, m),
        )  # fmt: skip
        ctx.save_for_backward(logits, weight, candidates)
        ctx.tau, ctx.kappa, ctx.noise, ctx.hard = tau, kappa, noise, hard
        return out.reshape(weight.shape)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001
        logits, weight, candidates = ctx.saved_tensors
        m = candidates.shape[1]
        flat = grad.float().reshape(-1, m)
        grad_logits = kernel.soft_mask_backward(
            logits.detach(), candidates, ctx.kappa, ctx.tau, ctx.noise, flat,
            weight.detach().reshape(-1, m),
        )  # fmt: skip
        grad_weight = None
        if ctx.needs_input_grad[1]:  # a trained weight: d(W ⊙ mask)/dW = mask
            mask = kernel.soft_mask_forward(
                logits.detach(), candidates, ctx.kappa, ctx.tau, ctx.noise, ctx.hard,
                MASK_FLOOR, None,
            )  # fmt: skip
            grad_weight = (flat * mask).reshape(weight.shape).to(weight.dtype)
        return grad_logits, grad_weight, None, None, None, None, None


def masked_weight(
    logits: torch.Tensor,
    weight: torch.Tensor,
    candidates: torch.Tensor,
    tau: float,
    kappa: float,
    noise: str,
    hard: bool = False,
) -> torch.Tensor:
    """``weight ⊙ mask`` for an ``(out, in)`` weight whose groups of ``m`` are rows of ``logits``
    (G, C): the same value and logits gradient as ``weight * soft_mask_replayed(...)`` with
    the same noise source (``hard``: straight-through), computed by the fused kernel."""
    return _MaskedWeight.apply(logits, weight, candidates, tau, kappa, draw_noise(noise), hard)
