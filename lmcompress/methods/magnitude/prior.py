"""Magnitude pruning as a pure mask function (the prior learned-mask methods start from)."""

from __future__ import annotations

import torch

from lmcompress.compressor.config import Sparsity
from lmcompress.compressor.sparsity import mask_from_scores


def magnitude_mask(W: torch.Tensor, stats: None, sparsity: Sparsity) -> torch.Tensor:  # noqa: ARG001
    """Keep-mask (bool, like W (out, in)) of the largest |W|: over the whole layer
    (unstructured) or per group of M input weights (N:M). Needs no statistics (``stats`` is
    there so that every prior has the signature ``mask(W, stats, sparsity)``)."""
    return mask_from_scores(W.abs(), sparsity)
