"""One-shot priors for learned masks (MaskLLM, subnetwork extraction): each pruner's pure
``mask(W, stats, sparsity)`` function and the statistic it needs, in one table (no method is run
by name, no registry is imported).

The end-to-end prior (:func:`one_shot_prior_masks`) keeps the one-shot method's semantics:
block by block through the layer-wise loop, each block is pruned with the prior's mask before
the next block's inputs are computed (so later blocks see pruned inputs, as when the pruner runs
on its own), and the dense weights are restored at the end. The block-wise mode computes the
same masks from the Hessian its loop already accumulates (:attr:`OneShotPrior.from_hessian`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lmcompress.compressor.calibration.layerwise import Accumulator, compress_layerwise
from lmcompress.compressor.calibration.observers import HessianAccumulator
from lmcompress.compressor.config import Sparsity
from lmcompress.compressor.model.surgery import weight_matrix
from lmcompress.errors import ConfigError
from lmcompress.methods.common import prune_layer_
from lmcompress.methods.magnitude.prior import magnitude_mask
from lmcompress.methods.sparsegpt.solver import sparsegpt_mask
from lmcompress.methods.wanda.scores import InputNorms, wanda_mask

# The one-shot pruners' calibration batch (``calib_batch_size``'s default): the statistics are
# sums over batches, so the batching is part of the result.
PRIOR_BATCH_SIZE = 8


@dataclass(frozen=True)
class OneShotPrior:
    """A one-shot pruner seen as a prior.

    ``mask(W, stats, sparsity) -> keep`` (bool, (out, in)); ``accumulator(in_features, device)``
    collects the layer statistic from its inputs (``None``: the mask needs none) and
    ``statistic(accumulator)`` reads it; ``from_hessian(H)`` gives the same statistic from
    ``H = 2/n Σ x xᵀ`` (the block-wise loop's accumulator).
    """

    mask: Callable[[torch.Tensor, Any, Sparsity], torch.Tensor]
    accumulator: Callable[[int, torch.device], Accumulator] | None
    statistic: Callable[[Any], Any]
    from_hessian: Callable[[torch.Tensor], Any]


ONE_SHOT_PRIORS: dict[str, OneShotPrior] = {
    "magnitude": OneShotPrior(
        mask=magnitude_mask,
        accumulator=None,
        statistic=lambda _acc: None,
        from_hessian=lambda _H: None,
    ),
    "wanda": OneShotPrior(  # input norms ‖X_j‖₂; from H: sqrt(H_jj) ∝ ‖X_j‖₂
        mask=wanda_mask,
        accumulator=lambda features, device: InputNorms(features, device=device),
        statistic=lambda acc: acc.norms,
        from_hessian=lambda H: H.diagonal().clamp_min(0).sqrt(),
    ),
    "sparsegpt": OneShotPrior(  # without weight update: the mask only
        mask=sparsegpt_mask,
        accumulator=lambda features, device: HessianAccumulator(features, device=device),
        statistic=lambda acc: acc.H,
        from_hessian=lambda H: H,
    ),
}


def one_shot_prior_masks(
    model: nn.Module,
    data: torch.Tensor | None,
    layers: dict[str, nn.Module],
    prior: str,
    sparsity_of: Callable[[str], Sparsity],
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """``{layer: keep (out, in) bool}`` of the one-shot ``prior``, exactly as running that
    pruner would select it; the model's weights are left as they were.

    A weight that is zero already counts as pruned (``keep & (W != 0)``): the mask is what the
    pruned weights show, as it always was here (SmolLM2's decoder linears hold ~33k exact
    zeros; counting them as kept would move the prior of a few groups)."""
    spec = ONE_SHOT_PRIORS[prior]
    if spec.accumulator is None:  # no statistics: no pass over the data either
        masks = {}
        for name, module in layers.items():
            W = weight_matrix(module).detach()
            masks[name] = spec.mask(W, None, sparsity_of(name)) & (W != 0)
        return masks
    if data is None:
        raise ConfigError(f"the {prior} prior needs calibration data")
    originals = {name: weight_matrix(module).detach().clone() for name, module in layers.items()}
    masks: dict[str, torch.Tensor] = {}

    def prune(name: str, module: nn.Module, accumulator: Accumulator):
        start = time.perf_counter()
        sparsity = sparsity_of(name)
        keep = spec.mask(weight_matrix(module).detach(), spec.statistic(accumulator), sparsity)
        masks[name] = keep
        return prune_layer_(name, module, keep, sparsity, start)  # later blocks see it pruned

    try:
        compress_layerwise(
            model,
            data,
            layers,
            make_accumulator=lambda _name, module: spec.accumulator(
                weight_matrix(module).shape[1], weight_matrix(module).device
            ),
            compress_layer=prune,
            device=device,
            batch_size=PRIOR_BATCH_SIZE,
        )
    finally:
        with torch.no_grad():
            for name, module in layers.items():
                weight_matrix(module).copy_(originals[name])
    return {name: masks[name].to(W.device) & (W != 0) for name, W in originals.items()}
