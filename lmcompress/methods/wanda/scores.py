"""Wanda (Sun et al. 2023, "A Simple and Effective Pruning Approach for LLMs"), the math.

Score ``S_ij = |W_ij| · ‖X_j‖₂`` where ``‖X_j‖₂`` is the norm of input feature j over every
calibration token (Eq. 1). Unstructured sparsity compares scores within each output row; N:M
keeps the top N of each group of M consecutive input weights. No weight update.
"""

from __future__ import annotations

import torch

from lmcompress.compressor.config import Sparsity
from lmcompress.compressor.sparsity import mask_from_scores


class InputNorms:
    """Accumulates ``Σ_tokens x_j²`` per input feature (float32)."""

    def __init__(self, in_features: int, device: torch.device | str = "cpu") -> None:
        self.sum_sq = torch.zeros(in_features, dtype=torch.float32, device=device)
        self.tokens = 0

    def add_batch(self, inputs: torch.Tensor) -> None:
        x = inputs.reshape(-1, inputs.shape[-1]).float()  # (tokens, in)
        self.sum_sq += x.square().sum(0)
        self.tokens += x.shape[0]

    @property
    def norms(self) -> torch.Tensor:
        return self.sum_sq.sqrt()  # (in,) ‖X_j‖₂


def wanda_mask(W: torch.Tensor, norms: torch.Tensor, sparsity: Sparsity) -> torch.Tensor:
    """Keep-mask (bool, like W (out, in)) from Wanda scores."""
    scores = W.abs().float() * norms.to(W.device)[None, :]  # (out, in)
    return mask_from_scores(scores, sparsity, per_row=True)
