"""The learnable N:M mask of one linear layer, as a ``torch.nn.utils.parametrize``
parametrization of its (frozen) weight: ``W -> W ⊙ mask(logits)``.

The trainer sets ``tau`` and ``kappa`` before each step (schedules are never computed inside
``forward``) and switches ``hard`` on to evaluate the argmax mask; ``bake`` removes the
parametrization and leaves ``W ⊙ hard_mask`` in the weight.
"""

from __future__ import annotations

import torch
from torch import nn

from lmcompress.methods.maskllm.masks import candidate_patterns, gumbel_noise, hard_mask, soft_mask


class LearnableNMMask(nn.Module):
    """Mask logits (groups, C) for an ``(out, in)`` weight (``transposed``: stored ``(in, out)``,
    as GPT-2's Conv1D does)."""

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

    def mask(self) -> torch.Tensor:
        """The current mask, (out, in): sampled soft mask in training, argmax otherwise."""
        if self.hard:
            groups = hard_mask(self.logits, self.candidates)
        else:
            noise = gumbel_noise(self.logits.shape, device=self.logits.device)
            groups = soft_mask(self.logits, self.candidates, self.tau, self.kappa, noise)
        return groups.reshape(self.shape)

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return weight
        mask = self.mask().to(weight.dtype)
        return weight * (mask.T if self.transposed else mask)
