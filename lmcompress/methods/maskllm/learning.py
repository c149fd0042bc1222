"""What MaskLLM's end-to-end and block-wise runs share: a layer's learnable mask, the τ/κ
schedules the trainer applies before each step, the sparse-weight term of the loss and the
argmax keep-mask (the drivers, the hard-mask perplexity among them, are the core's
``compressor.training.drivers``; the re-fit is ``sparsegpt.refit``).

The sparse-weight term (paper Sec. 3.4) is ``− λ (1 − step/steps) Σ ‖W ⊙ mask‖²``; with
``weight_reg_norm`` the sum is divided by the layers' total ``Σ ‖W‖²`` (a kept-mass fraction in
[0, 1]), so λ no longer depends on the model's size: at λ = 1e-5 the raw term (~14 on SmolLM2)
outweighs the LM loss (~3)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle
from transformers.pytorch_utils import Conv1D

from lmcompress.compressor.model.surgery import add_parametrization, weight_matrix
from lmcompress.compressor.training import distributed
from lmcompress.compressor.training.drivers import ExtraLoss
from lmcompress.compressor.training.gumbel import candidate_patterns, linear_schedule
from lmcompress.kernels import soft_mask as kernel
from lmcompress.methods.maskllm import quant_aware
from lmcompress.methods.maskllm.config import MaskLLMConfig
from lmcompress.methods.maskllm.masks import hard_mask, init_logits, prior_logits
from lmcompress.methods.maskllm.parametrization import LearnableNMMask


def new_mask(
    config: MaskLLMConfig,
    name: str,
    module: nn.Module,
    prior: torch.Tensor | None,
    generator: torch.Generator,
) -> LearnableNMMask:
    """Logits N(0, init_std²) for ``module``'s groups, shifted by the prior keep-mask (if any),
    as a parametrization of its weight."""
    sparsity = config.sparsity_of(name)
    W = weight_matrix(module)
    candidates = candidate_patterns(sparsity.n, sparsity.m)
    logits = init_logits(W.numel() // sparsity.m, len(candidates), config.init_std, generator)
    if prior is not None:
        logits = prior_logits(
            logits, prior.reshape(-1, sparsity.m), candidates, config.prior_strength
        )
    mask = LearnableNMMask(
        logits.to(W.device),
        sparsity.n,
        sparsity.m,
        tuple(W.shape),
        transposed=isinstance(module, Conv1D),
    )
    mask.noise = config.noise
    add_parametrization(module, mask)
    return mask


def quant_aware_hooks(
    config: MaskLLMConfig, layers: dict[str, nn.Module], masks: dict[str, LearnableNMMask]
) -> list[RemovableHandle]:
    """With ``quant_aware`` int8, fake-quantize each layer's masked weight and input (see
    :mod:`quant_aware`); the handles remove the input hooks (the weight's goes with the
    parametrizations). Call after ``new_mask``, in the same order as the layers."""
    if config.quant_aware == "none":
        return []
    return [quant_aware.attach(layers[n], masks[n]) for n in masks]


def schedules(
    config: MaskLLMConfig, masks: dict[str, LearnableNMMask], steps: int
) -> Callable[[int], dict[str, float]]:
    """``before_step(step)`` for the trainer: sets τ, κ and straight-through on every mask and
    logs them with the fraction of groups whose argmax changed since the last step."""

    def argmax(mask: LearnableNMMask) -> torch.Tensor:  # small ints: 1 byte for 2:4
        # this process's groups only, under FSDP (the counts are summed over processes)
        logits = distributed.local_tensor(mask.logits.detach())
        if logits.shape[-1] > 256:
            return logits.argmax(-1).to(torch.int32)
        if kernel.soft_mask_supported(mask.candidates, logits):
            return kernel.group_argmax(logits)  # one pass: ~10x torch's at C = 6
        return logits.argmax(-1).to(torch.uint8)

    last_argmax = {n: argmax(m) for n, m in masks.items()}

    def before_step(step: int) -> dict[str, float]:
        tau = linear_schedule(*config.tau, step, steps)
        kappa = linear_schedule(*config.kappa, step, steps)
        straight = step >= config.straight_through_from * steps and config.straight_through_from < 1
        flipped = groups = 0
        for name, mask in masks.items():
            mask.tau, mask.kappa, mask.straight_through = tau, kappa, straight
            current = argmax(mask)
            flipped += int((current != last_argmax[name]).sum())
            groups += current.numel()
            last_argmax[name] = current
        if any(distributed.is_sharded(m.logits) for m in masks.values()):
            flipped, groups = distributed.all_reduce_sum([flipped, groups])
        return {"tau": tau, "kappa": kappa, "flipped": flipped / max(groups, 1)}

    return before_step


def sparse_weight_term(config: MaskLLMConfig, modules: list[nn.Module]) -> ExtraLoss:
    """The driver's ``extra_loss(step)``: the decaying sparse-weight term of ``modules``
    (see the module doc). Evaluated inside the driver's ``parametrize.cached()``, so the
    masked weights are the forward's sample.

    Call it where the method's random-number order expects it: with ``modules`` already
    parametrized, the normalising mass below is that of one masked sample (drawing from the
    global RNG), not of the dense weights ‖W‖² (kept so: changing it changes learned masks)."""
    steps = config.training.steps
    mass = sum(float(weight_matrix(m).detach().square().sum()) for m in modules)

    def extra_loss(step: int) -> tuple[torch.Tensor, dict[str, float]]:
        reg = sum(weight_matrix(m).square().sum() for m in modules)
        if config.weight_reg_norm:
            reg = reg / mass
        return -config.weight_reg * (1 - step / steps) * reg, {"reg": float(reg.detach())}

    return extra_loss


def keep_mask(config: MaskLLMConfig, name: str, module: nn.Module, logits: torch.Tensor):
    """The argmax keep-mask of ``logits``, bool (out, in)."""
    sparsity = config.sparsity_of(name)
    keep = hard_mask(logits.detach().cpu(), candidate_patterns(sparsity.n, sparsity.m))
    return keep.reshape(weight_matrix(module).shape).bool()
