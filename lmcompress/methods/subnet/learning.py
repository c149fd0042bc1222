"""What subnetwork extraction's end-to-end and block-wise runs share: a layer's learnable
subnetwork (initial logits from a one-shot prior), the sparsity constraint on the expected keep
rate, and extraction (the scale folded into the kept weights, or the kept weights re-fitted).

The constraint, per unstructured layer with target keep rate ``k`` and expected keep rate
``r = mean(sigmoid(logits))``, on the relative deviation ``d = (r − k) / k``:

- ``penalty``: ``w · mean_l d_l²`` (a fixed weight ``w``);
- ``lagrangian``: ``Σ_l λ1_l d_l + λ2_l d_l²`` whose multipliers are trained by gradient
  *ascent* (their gradient is reversed; learning rate ``w``), as in L0-regularised structured
  pruning (Wang et al. 2020; Sheared LLaMA): the multipliers grow while the rate is off target,
  so the optimum is on the constraint rather than at "keep everything".

``d`` pulls each logit with a gradient ∝ 1 / (k · N_l), ``N_l`` the layer's size: small layers
and small targets are pulled hardest. ``constraint_scale="size"`` multiplies ``d_l`` by
``N_l / mean_l N_l``, the same pull on a logit in every layer.

N:M layers keep exactly ``n`` of ``m`` by construction and get no term.

``tau_end`` and ``kappa`` are MaskLLM's schedules on this sampler: τ linear from ``tau`` to
``tau_end`` (every layer's relaxation; the hard forward sample does not depend on τ), κ linear
from ``kappa[0]`` to ``kappa[1]`` on the N:M layers' pattern logits (κ > 1 sharpens the
sampled distribution towards the extracted pattern as training ends).
"""

from __future__ import annotations

import time

import torch
from torch import nn
from torch.nn.utils import parametrize
from transformers.pytorch_utils import Conv1D

from lmcompress.compressor.model.surgery import add_parametrization, weight_matrix
from lmcompress.compressor.report import LayerReport
from lmcompress.compressor.training.drivers import Learnable
from lmcompress.compressor.training.gumbel import linear_schedule
from lmcompress.methods.common import prune_layer_
from lmcompress.methods.subnet.config import SubnetConfig
from lmcompress.methods.subnet.parametrization import KeepLogitMask
from lmcompress.methods.subnet.sampling import extract_keep


def new_mask(
    config: SubnetConfig, name: str, module: nn.Module, prior: torch.Tensor | None
) -> KeepLogitMask:
    """Logits ``±prior_strength`` where the prior keeps / drops (all 0 without a prior: keep
    probability 1/2, the paper's start), as a parametrization of ``module``'s weight."""
    W = weight_matrix(module)
    logits = torch.zeros(W.shape, dtype=torch.float32, device=W.device)
    if prior is not None:
        logits = torch.where(prior.to(W.device), config.prior_strength, -config.prior_strength)
        logits = logits.to(torch.float32)
    target = config.sparsity_of(name) if config.extract == "topk" else None
    mask = KeepLogitMask(
        logits, target, config.scale, config.tau, transposed=isinstance(module, Conv1D)
    )
    add_parametrization(module, mask)
    return mask


class GradientReversal(torch.autograd.Function):
    """Identity forward, negated gradient: descent on the loss is ascent on a multiplier."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ARG004
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ARG004
        return -grad


class KeepRateConstraint(nn.Module):
    """The constraint term of the unstructured layers among ``masks`` (see the module doc)."""

    def __init__(self, config: SubnetConfig, masks: dict[str, KeepLogitMask]) -> None:
        super().__init__()
        self.kind, self.weight = config.constraint, config.constraint_weight
        self.masks = {n: m for n, m in masks.items() if not config.sparsity_of(n).is_nm}
        self.targets = {n: 1.0 - config.sparsity_of(n).ratio for n in self.masks}
        sizes = torch.tensor([float(m.logits.numel()) for m in self.masks.values()])
        size_scaled = config.constraint_scale == "size" and len(sizes) > 0
        self.register_buffer(
            "scales", sizes / sizes.mean() if size_scaled else torch.ones(len(sizes))
        )
        layers = len(self.masks)
        self.multipliers = nn.Parameter(torch.zeros(2, layers)) if layers else None

    def trainable(self, prefix: str) -> tuple[dict[str, nn.Parameter], dict[str, dict]]:
        if self.kind != "lagrangian" or self.multipliers is None:
            return {}, {}
        name = f"{prefix}.multipliers"
        return {name: self.multipliers}, {name: {"lr": self.weight, "weight_decay": 0.0}}

    def deviations(self) -> torch.Tensor:
        """``(r_l − k_l) / k_l`` per constrained layer (``constraint_scale="size"``: times
        ``N_l / mean N``, so that a logit's pull no longer shrinks with its layer's size)."""
        relative = torch.stack(
            [
                (torch.sigmoid(m.logits).mean() - self.targets[n]) / self.targets[n]
                for n, m in self.masks.items()
            ]
        )
        return relative * self.scales

    def forward(self, _step: int) -> tuple[torch.Tensor, dict[str, float]]:
        if self.kind == "none" or not self.masks:
            return torch.zeros(()), {}
        d = self.deviations()
        logs = {"keep_dev": float((d.detach() / self.scales).abs().max())}  # relative
        if self.kind == "penalty":
            return self.weight * d.square().mean(), logs
        lam = GradientReversal.apply(self.multipliers)
        logs["lambda"] = float(self.multipliers.detach().abs().max())
        return (lam[0] * d).sum() + (lam[1] * d.square()).sum(), logs


def keep_of(config: SubnetConfig, name: str, logits: torch.Tensor) -> torch.Tensor:
    """The keep-mask extracted from ``name``'s ``logits``, bool (out, in)."""
    target = config.sparsity_of(name) if config.extract == "topk" else None
    return extract_keep(logits, target)


def dense_keep(config: SubnetConfig, name: str, module: nn.Module, logits: torch.Tensor):
    """Remove ``module``'s parametrization, leaving its frozen dense weight, and return the
    extracted keep-mask (bool (out, in)): what a re-fit starts from."""
    if parametrize.is_parametrized(module, "weight"):
        parametrize.remove_parametrizations(module, "weight", leave_parametrized=False)
    return keep_of(config, name, logits.to(weight_matrix(module).device))


def extract_layer(
    config: SubnetConfig,
    name: str,
    module: nn.Module,
    logits: torch.Tensor,
    scale: torch.Tensor | None,
    started: float | None = None,
) -> LayerReport:
    """Remove ``module``'s parametrization (the frozen weight comes back), keep its extracted
    mask and fold the scale into the kept weights (``scale`` None: leave the weights as they
    are, e.g. after a re-fit)."""
    started = time.perf_counter() if started is None else started
    keep = dense_keep(config, name, module, logits)
    W = weight_matrix(module).detach()
    new_weight = None if scale is None else W * scale.to(W.device, W.dtype)
    return prune_layer_(name, module, keep, config.sparsity_of(name), started, new_weight)


def schedules(config: SubnetConfig, masks: dict[str, KeepLogitMask], steps: int):
    """``before_step(step)`` setting τ and κ on every mask over ``steps`` (None: no schedule,
    constant τ and κ 1, nothing logged)."""
    if config.tau_end is None and config.kappa == (1.0, 1.0):
        return None

    def before_step(step: int) -> dict[str, float]:
        tau = linear_schedule(config.tau, config.tau_end or config.tau, step, steps)
        kappa = linear_schedule(*config.kappa, step, steps)
        for mask in masks.values():
            mask.tau, mask.kappa = tau, kappa
        return {"tau": tau, "kappa": kappa}

    return before_step


def learnable(config: SubnetConfig, masks: dict[str, KeepLogitMask], steps: int) -> Learnable:
    """The logits (the trainer's lr), the scales (``scale_lr``, no weight decay) and the
    constraint's multipliers, with the constraint as the extra loss term and the τ/κ schedules
    over ``steps``; ``masks`` switch to their extracted (``hard``) form for the hard perplexity
    and block error."""
    params: dict[str, nn.Parameter] = {}
    options: dict[str, dict[str, float]] = {}
    for name, mask in masks.items():
        params.update(mask.trainable(name))
        if mask.scale is not None:
            options[f"{name}.scale"] = {"lr": config.scale_lr, "weight_decay": 0.0}
    constraint = KeepRateConstraint(config, masks)
    extra, extra_options = constraint.trainable("constraint")
    return Learnable(
        params={**params, **extra},
        extra_loss=constraint,
        param_options={**options, **extra_options},
        before_step=schedules(config, masks, steps),
        masks=list(masks.values()),
    )
