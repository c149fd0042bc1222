"""The learnable N:M mask of one linear layer, as a ``torch.nn.utils.parametrize``
parametrization of its (frozen) weight: ``W -> W ⊙ mask(logits)``.

The trainer sets ``tau`` and ``kappa`` before each step (schedules are never computed inside
``forward``) and switches ``hard`` on to evaluate the argmax mask; ``bake`` removes the
parametrization and leaves ``W ⊙ hard_mask`` in the weight. Two training options, plain
attributes too: ``noise`` ("exact": fresh ``gumbel_noise`` every forward; "pool": windows of
the shared ``GumbelPool``, 7-35x cheaper measured on CPU, correlated across calls) and
``straight_through`` (forward the sampled exact N:M pattern, backward the soft mask's gradient).
"""

from __future__ import annotations

import torch
from torch import nn

from lmcompress.compressor.training.gumbel import (
    NOISES,
    candidate_patterns,
    gumbel_noise,
    pooled_gumbel_noise,
    replayable_noise,
)
from lmcompress.methods.maskllm import fused
from lmcompress.methods.maskllm.masks import MASK_FLOOR, hard_mask, soft_mask, soft_mask_replayed


class LearnableNMMask(nn.Module):
    """Mask logits (groups, C) for an ``(out, in)`` weight (``transposed``: stored ``(in, out)``,
    as GPT-2's Conv1D does)."""

    # noise "pool" and "counter" use the fused CPU kernel where it runs (``fused``); False: the
    # torch path (the same values to float rounding)
    use_kernel: bool = True

    def __init__(
        self, logits: torch.Tensor, n: int, m: int, shape: tuple[int, int], transposed: bool = False
    ) -> None:
        super().__init__()
        out_features, in_features = shape
        if logits.shape[0] * m != out_features * in_features:
            raise ValueError(f"{logits.shape[0]} groups of {m} do not cover a {shape} weight")
        self.logits = nn.Parameter(logits)
        self.register_buffer("candidates", candidate_patterns(n, m, dtype=logits.dtype))
        self.shape, self.transposed = shape, transposed
        self.tau, self.kappa, self.hard = 4.0, 100.0, False
        self.enabled = True  # False: the dense weight (a distillation teacher)
        self.noise: str = "exact"  # or "pool": the shared GumbelPool (see gumbel.GumbelPool)
        self.straight_through = False  # True: forward the sampled N:M pattern, soft gradient
        # True: keep no (G, C) probabilities for backward, replay the noise instead (less
        # memory, one more noise draw); False: plain autograd through ``soft_mask``.
        self.recompute = True

    def sample_noise(self) -> torch.Tensor:
        """Gumbel(0, 1) noise shaped like the logits, from the ``noise`` source."""
        shape, device = self.logits.shape, self.logits.device
        if self.noise == "exact":
            return gumbel_noise(shape, device=device)
        if self.noise == "pool":
            return pooled_gumbel_noise(shape, device=device, dtype=self.logits.dtype)
        if self.noise == "counter":  # fresh: one seed from the global RNG, as the replay draws
            return replayable_noise("counter", shape, device, self.logits.dtype)()
        raise ValueError(f"noise must be one of {NOISES}, got {self.noise!r}")

    def mask(self) -> torch.Tensor:
        """The current mask, (out, in): the argmax candidate if ``hard``; otherwise a Gumbel
        sample, soft or (``straight_through``) hard in forward with the soft gradient."""
        if self.hard:
            groups = hard_mask(self.logits, self.candidates)
        elif self.recompute:
            if self.noise not in NOISES:
                raise ValueError(f"noise must be one of {NOISES}, got {self.noise!r}")
            noise_fn = replayable_noise(
                self.noise, self.logits.shape, self.logits.device, self.logits.dtype
            )
            groups = soft_mask_replayed(
                self.logits, self.candidates, self.tau, self.kappa, noise_fn, self.straight_through
            )
        else:
            groups = soft_mask(
                self.logits,
                self.candidates,
                self.tau,
                self.kappa,
                self.sample_noise(),
                hard=self.straight_through,
            )
            groups = groups.masked_fill(groups < MASK_FLOOR, 0.0)  # no subnormal weights
        return groups.reshape(self.shape)

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return weight
        if (
            self.use_kernel
            and not self.hard
            and self.recompute
            and not self.transposed
            and fused.fused_supported(self.noise, self.logits, self.candidates, weight)
        ):  # one kernel pass per direction (see ``fused``); same values, same RNG draws
            return fused.masked_weight(
                self.logits, weight, self.candidates, self.tau, self.kappa, self.noise,
                self.straight_through,
            )  # fmt: skip
        mask = self.mask().to(weight.dtype)
        return weight * (mask.T if self.transposed else mask)
