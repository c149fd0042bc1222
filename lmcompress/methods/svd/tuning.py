"""Training a low-rank model's factor pairs (beyond the reference implementations, which keep
the truncation as it is): ``--tune-steps`` block by block on the block-output error
(``sequential.compress_sequential`` through the core's ``drivers.learn_blockwise``), and
``--distill-steps`` end to end on the KL divergence from the dense model's logits (the
core's ``drivers.learn_end_to_end``, the teacher the same model with every
:class:`FactorWeight` switched off, i.e. the dense weights).

Both train the factors as a parametrization of the original layer's weight, ``W -> B A``, with
the optimiser of ``training.tuning.TUNE_OPTIMIZER``; afterwards the trained pair is copied into
the layer's ``LowRankLinear``, which replaces the module at the end.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from lmcompress.compressor.formats.low_rank import LowRankLinear
from lmcompress.compressor.model.surgery import add_parametrization, bake
from lmcompress.compressor.report import LayerReport
from lmcompress.compressor.training.drivers import Learnable, learn_end_to_end
from lmcompress.compressor.training.trainer import TrainConfig


class FactorWeight(nn.Module):
    """Parametrization ``W -> B A`` by a trainable float32 factor pair (``transposed``: the
    stored weight is (in, out), GPT-2's Conv1D); with ``enabled`` off, the stored weight as it
    is (end-to-end distillation's teacher: there, the dense weight).

    The pair is balanced first (row j of A and column j of B scaled to the same norm, the
    product unchanged): a weighted SVD's factors are not (GFWSVD's B carries the inverse of
    the gradient factor, orders of magnitude larger than A), and AdamW's steps, about the same
    size for every element, would otherwise move the small factor by a large fraction."""

    def __init__(self, A: torch.Tensor, B: torch.Tensor, transposed: bool) -> None:
        super().__init__()
        A, B = A.detach().to(torch.float32), B.detach().to(torch.float32)
        scale = (B.norm(dim=0) / A.norm(dim=1).clamp_min(1e-30)).clamp_min(1e-30).sqrt()  # (r,)
        self.A = nn.Parameter(A * scale[:, None])  # (r, in)
        self.B = nn.Parameter(B / scale[None, :])  # (out, r)
        self.transposed = transposed
        self.enabled = True

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return weight
        W = self.B @ self.A
        return (W.T if self.transposed else W).to(weight.dtype)


def _parametrize(
    layers: dict[str, nn.Module], built: dict[str, LowRankLinear | None]
) -> dict[str, FactorWeight]:
    """A :class:`FactorWeight` on every layer that has a factor pair in ``built``."""
    factors = {}
    for name, module in layers.items():
        if built[name] is not None:
            factors[name] = FactorWeight(built[name].A, built[name].B, isinstance(module, Conv1D))
            add_parametrization(module, factors[name])
    return factors


@torch.no_grad()
def _copy_back(
    layers: dict[str, nn.Module], built: dict[str, LowRankLinear | None], factors: dict
) -> None:
    """The trained pairs into ``built``; each layer's weight becomes ``B A`` (baked)."""
    for name, factor in factors.items():
        built[name].A.copy_(factor.A)
        built[name].B.copy_(factor.B)
        bake(layers[name])


def _learnable(factors: dict[str, FactorWeight], **fields) -> Learnable:
    """Every pair's A and B, no weight decay; ``fields``: the rest of the ``Learnable``."""
    params = {f"{n}.{k}": getattr(f, k) for n, f in factors.items() for k in ("A", "B")}
    options = {k: {"weight_decay": 0.0} for k in params}
    return Learnable(params=params, param_options=options, **fields)


def block_learnable(
    layers: dict[str, nn.Module], built: dict[str, LowRankLinear | None], reports: list
) -> Learnable:
    """The factor pairs of one block's layers (``built``, None: dense, not trained) to train
    on the block error; ``finish`` copies them back and bakes ``B A``."""
    factors = _parametrize(layers, built)

    def finish() -> list[LayerReport]:
        _copy_back(layers, built, factors)
        return reports

    return _learnable(factors, finish=finish)


def distill_factors(
    model: nn.Module,
    data: torch.Tensor,
    layers: dict[str, nn.Module],
    built: dict[str, LowRankLinear | None],
    dense: dict[str, torch.Tensor],
    config: TrainConfig,
) -> list[dict]:
    """Train every factor pair in ``built`` end to end on ``data`` (N, L) windows on
    KL(dense ‖ low rank) of the logits alone (the LM loss of so few windows would fit them, not
    the dense model; it is logged), the teacher the layers' ``dense`` stored weights
    (as stored: Conv1D's (in, out)). Returns the loss curve."""
    with torch.no_grad():
        for name in built:
            if built[name] is not None:
                layers[name].weight.copy_(dense[name])
    factors = _parametrize(layers, built)
    learnable = _learnable(factors, masks=list(factors.values()))
    with torch.enable_grad():  # also under a caller's no_grad
        result = learn_end_to_end(model, data, learnable, config, distill=True, lm_loss=False)
    _copy_back(layers, built, factors)
    return result.state.history
