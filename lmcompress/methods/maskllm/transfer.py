"""MaskLLM mask transfer (``--prior-from``): the argmax masks of an earlier maskllm output."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from lmcompress.compressor.config import Sparsity
from lmcompress.compressor.io.layout import STATS
from lmcompress.compressor.io.shards import read_safetensors
from lmcompress.compressor.model.surgery import weight_matrix
from lmcompress.compressor.training.gumbel import candidate_patterns
from lmcompress.errors import ConfigError
from lmcompress.methods.maskllm.masks import hard_mask


def learned_prior_masks(
    prior_from: str | Path, layers: dict[str, nn.Module], sparsity_of: Callable[[str], Sparsity]
) -> dict[str, torch.Tensor]:
    """The argmax masks of a learned-mask output directory (``--prior-from``: mask transfer)."""
    path = Path(prior_from) / STATS
    if not path.is_file():
        raise ConfigError(f"--prior-from {prior_from}: no {STATS} (not a maskllm output)")
    saved, _ = read_safetensors(path)
    masks = {}
    for name, module in layers.items():
        if f"{name}.logits" not in saved:
            raise ConfigError(f"--prior-from {prior_from} has no mask for {name}")
        sparsity = sparsity_of(name)
        keep = hard_mask(saved[f"{name}.logits"], candidate_patterns(sparsity.n, sparsity.m))
        masks[name] = keep.bool().reshape(weight_matrix(module).shape)
    return masks
