"""Masks from importance scores: the pure math every pruning method shares.

N:M groups are ``m`` consecutive weights along the *input* dimension of an ``(out, in)``
weight, the layout 2:4 sparse tensor cores and every packed 2:4 format use.
"""

from __future__ import annotations

import torch

from lmcompress.compressor.config import Sparsity
from lmcompress.errors import ConfigError


def check_nm_shape(shape: tuple[int, ...], m: int, name: str = "layer") -> None:
    if shape[-1] % m:
        raise ConfigError(
            f"{name}: in_features={shape[-1]} is not divisible by M={m}; exclude the layer or "
            "choose another M"
        )


def nm_mask(scores: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """Keep the ``n`` highest scores of every group of ``m`` consecutive input weights.

    scores: (out, in) with in % m == 0. Returns a bool mask of the same shape.
    """
    check_nm_shape(tuple(scores.shape), m)
    groups = scores.reshape(-1, m)  # (out * in / m, m)
    keep = torch.zeros_like(groups, dtype=torch.bool)
    keep.scatter_(1, groups.topk(n, dim=1).indices, True)
    return keep.reshape(scores.shape)


def unstructured_mask(scores: torch.Tensor, ratio: float, per_row: bool = False) -> torch.Tensor:
    """Remove the ``ratio`` lowest-scoring weights, over the whole layer or within each row
    (Wanda compares per output row). Returns a bool keep-mask."""
    if per_row:
        k = int(scores.shape[-1] * ratio)
        drop = scores.topk(k, dim=-1, largest=False).indices
        keep = torch.ones_like(scores, dtype=torch.bool)
        keep.scatter_(-1, drop, False)
        return keep
    k = int(scores.numel() * ratio)
    keep = torch.ones(scores.numel(), dtype=torch.bool, device=scores.device)
    if k:
        keep[scores.flatten().topk(k, largest=False).indices] = False
    return keep.reshape(scores.shape)


def mask_from_scores(
    scores: torch.Tensor, sparsity: Sparsity, per_row: bool = False
) -> torch.Tensor:
    if sparsity.is_nm:
        return nm_mask(scores, sparsity.n, sparsity.m)
    return unstructured_mask(scores, sparsity.ratio, per_row=per_row)
