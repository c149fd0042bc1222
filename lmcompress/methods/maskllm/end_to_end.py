"""MaskLLM end to end (the paper): every selected linear gets learnable N:M mask logits (shifted
by a one-shot prior), trained together on the LM loss by the core's ``learn_end_to_end``
(weights frozen), optionally under ``accelerate`` (data parallel, or the logits sharded with
FSDP) and with distillation from the dense model's logits (``distill``).

Loss (paper Sec. 3.4): ``LM loss − λ (1 − step/steps) Σ ‖W ⊙ mask‖²`` (``learning.
sparse_weight_term``), plus KL(dense || masked) with ``distill``.
"""

from __future__ import annotations

import time

import torch
from torch import nn
from torch.nn.utils import parametrize

from lmcompress.compressor.method import Stats
from lmcompress.compressor.training import distributed
from lmcompress.compressor.training.checkpoint import Checkpoints
from lmcompress.compressor.training.drivers import (
    MMAP_THRESHOLD,
    Learnable,
    learn_end_to_end,
)
from lmcompress.compressor.training.trainer import TrainConfig
from lmcompress.methods.common import hard_perplexity, held_out_perplexity
from lmcompress.methods.maskllm import learning
from lmcompress.methods.maskllm.config import MaskLLMConfig
from lmcompress.methods.maskllm.transfer import learned_prior_masks
from lmcompress.methods.priors import one_shot_prior_masks
from lmcompress.methods.sparsegpt.refit import refit


def prior_masks(
    config: MaskLLMConfig,
    model: nn.Module,
    data: torch.Tensor,
    layers: dict[str, nn.Module],
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """``{layer: keep (out, in) bool}`` to start from: a learned mask (``prior_from``), the
    one-shot prior's masks, or none."""
    if config.prior_from:
        return learned_prior_masks(config.prior_from, layers, config.sparsity_of)
    if config.prior == "none":
        return {}
    return one_shot_prior_masks(model, data, layers, config.prior, config.sparsity_of, device)


def calibrate_end_to_end(
    config: MaskLLMConfig,
    model: nn.Module,
    train_data: torch.Tensor,
    eval_data: torch.Tensor | None,
    layers: dict[str, nn.Module],
    device: torch.device | None,
) -> Stats:
    """Train the masks of ``layers`` end to end; the learned logits are the stats (whole
    tensors, gathered under FSDP)."""
    training = config.training
    start = time.perf_counter()
    compute = device or next(model.parameters()).device
    priors = prior_masks(config, model, train_data, layers, compute)
    generator = torch.Generator().manual_seed(training.train_seed)
    masks = {
        name: learning.new_mask(config, name, module, priors.get(name), generator)
        for name, module in layers.items()
    }
    hooks = learning.quant_aware_hooks(config, layers, masks)
    # joins the processes, if several; with --fsdp each keeps 1/world of the logits (sharding
    # replaces them: the learnable below takes the sharded ones)
    accelerator = distributed.join_processes(
        next(model.parameters()).device, training.fsdp, masks.values()
    )
    held = sum(distributed.local_tensor(m.logits).numel() for m in masks.values())
    learnable = Learnable(
        params={n: m.logits for n, m in masks.items()},
        extra_loss=learning.sparse_weight_term(config, list(layers.values())),
        before_step=learning.schedules(config, masks, training.steps),
        masks=list(masks.values()),
    )
    torch.manual_seed(training.train_seed)  # the Gumbel noise comes from the global RNG
    result = learn_end_to_end(
        model,
        train_data,
        learnable,
        TrainConfig.from_options(training, mmap_threshold=MMAP_THRESHOLD),
        score=held_out_perplexity(model, eval_data),
        checkpoints=Checkpoints.of(config),
        accelerator=accelerator,
        distill=config.distill,
    )
    # the whole logits (gathered under FSDP); the parametrizations, which hold the trained
    # ones, are removed in ``apply``, so no copy is needed
    logits = {n: distributed.full_tensor(m.logits.detach()) for n, m in masks.items()}
    meta = {
        "history": result.state.history,
        "evals": result.state.evals,
        "step0": result.step0,
        "trainable_elements_per_process": held,
    }
    for hook in hooks:  # the input fake quantization (the weight's goes with the masks)
        hook.remove()
    if config.scope.refit != "none":
        for module in layers.values():  # back to the original dense weights
            parametrize.remove_parametrizations(module, "weight", leave_parametrized=False)
        keeps = {n: learning.keep_mask(config, n, layers[n], logits[n]) for n in layers}
        quantize = config.quant_aware == "int8"
        meta["layer_errors"] = refit(config, model, train_data, layers, keeps, compute, quantize)
        meta["evals"] = meta["evals"] + [
            {
                "step": training.steps,
                "refit": config.scope.refit,
                **hard_perplexity(model, eval_data),
            }
        ]
    meta["seconds"] = time.perf_counter() - start
    return Stats(tensors={f"{n}.logits": t for n, t in logits.items()}, meta=meta)
