"""MaskLLM block-wise (beyond the paper): inside the layer-wise loop, block i learns its masks
so that its output matches the dense model's hidden states after block i, from the compressed
model's hidden states entering it (the core's ``drivers.learn_blockwise``: a dense stream runs
alongside, so earlier blocks' errors are compensated, not accumulated; ``steps`` are per block,
each one block's forward and backward). The prior comes from the same loop: the one-shot
prior's mask from the Hessian it accumulates. With ``--checkpoint-dir`` each block is
checkpointed (``--checkpoint-every`` steps within it, and once trained) and ``--resume``
continues a killed run to exactly the uninterrupted result.
"""

from __future__ import annotations

import time

import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.utils.hooks import RemovableHandle

from lmcompress.compressor.calibration.layerwise import Accumulator
from lmcompress.compressor.method import Stats
from lmcompress.compressor.model.surgery import weight_matrix
from lmcompress.compressor.report import LayerReport
from lmcompress.compressor.training.checkpoint import Checkpoints
from lmcompress.compressor.training.drivers import Learnable, learn_blockwise
from lmcompress.compressor.training.trainer import TrainConfig
from lmcompress.compressor.training.tuning import tune_kept_weights
from lmcompress.methods.common import hard_perplexity, prune_layer_
from lmcompress.methods.maskllm import learning
from lmcompress.methods.maskllm.config import MaskLLMConfig
from lmcompress.methods.maskllm.parametrization import LearnableNMMask
from lmcompress.methods.maskllm.transfer import learned_prior_masks
from lmcompress.methods.priors import ONE_SHOT_PRIORS
from lmcompress.methods.sparsegpt.refit import hessian, refit_layer


def _block_prior(
    config: MaskLLMConfig,
    name: str,
    module: nn.Module,
    H: torch.Tensor,
    loaded: dict[str, torch.Tensor],
) -> torch.Tensor | None:
    """The prior keep-mask of one layer from its Hessian on the compressed inputs."""
    if config.prior_from:
        return loaded[name]
    if config.prior == "none":
        return None
    prior = ONE_SHOT_PRIORS[config.prior]
    W = weight_matrix(module).detach()
    return prior.mask(W, prior.from_hessian(H), config.sparsity_of(name))


def _finish_block(
    config: MaskLLMConfig,
    names: list[str],
    layers: dict[str, nn.Module],
    masks: dict[str, LearnableNMMask],
    accumulators: dict[str, Accumulator],
    logits: dict[str, torch.Tensor],
    hooks: list[RemovableHandle],
) -> list[LayerReport]:
    """Keep each trained layer's logits (into ``logits``), remove its parametrization (and the
    fake quantization's ``hooks``) and prune it to the argmax mask, or re-fit its kept weights
    (``refit``) with the Hessian on the compressed inputs, onto the int8 grid if quant-aware."""
    for hook in hooks:
        hook.remove()
    reports = []
    for n in names:
        logits[n] = masks[n].logits.detach().cpu().clone()
        parametrize.remove_parametrizations(layers[n], "weight", leave_parametrized=False)
        keep = learning.keep_mask(config, n, layers[n], logits[n])
        if config.scope.refit == "sparsegpt":
            H, quantize = accumulators[n].H, config.quant_aware == "int8"
            reports.append(refit_layer(config, n, layers[n], H, keep, quantize))
        else:
            sparsity = config.sparsity_of(n)
            reports.append(prune_layer_(n, layers[n], keep, sparsity, time.perf_counter()))
    return reports


def _tune(
    config: MaskLLMConfig,
    names: list[str],
    layers: dict[str, nn.Module],
    logits: dict[str, torch.Tensor],
) -> Learnable:
    """The second training of a finished block (``--tune-steps``): its kept weights under the
    learned masks (``training.tuning``)."""
    keeps = {n: learning.keep_mask(config, n, layers[n], logits[n]) for n in names}
    scope = config.scope
    return tune_kept_weights({n: layers[n] for n in names}, keeps, scope.tune_steps, scope.tune_lr)


def calibrate_blockwise(
    config: MaskLLMConfig,
    model: nn.Module,
    train_data: torch.Tensor,
    eval_data: torch.Tensor | None,
    layers: dict[str, nn.Module],
    device: torch.device | None,
) -> Stats:
    """Learn the masks of ``layers`` block by block; the learned logits are the stats."""
    training, scope = config.training, config.scope
    loaded = (
        learned_prior_masks(config.prior_from, layers, config.sparsity_of)
        if config.prior_from
        else {}
    )
    generator = torch.Generator().manual_seed(training.train_seed)
    torch.manual_seed(training.train_seed)  # the Gumbel noise comes from the global RNG
    logits: dict[str, torch.Tensor] = {}
    held = 0  # mask-logit elements: one process trains every block's in turn

    def start_block(_index: int, names: list[str], accumulators: dict) -> Learnable:
        nonlocal held
        masks = {
            n: learning.new_mask(
                config,
                n,
                layers[n],
                _block_prior(config, n, layers[n], accumulators[n].H, loaded),
                generator,
            )
            for n in names
        }
        held += sum(m.logits.numel() for m in masks.values())
        hooks = learning.quant_aware_hooks(config, {n: layers[n] for n in names}, masks)
        return Learnable(
            params={n: m.logits for n, m in masks.items()},
            extra_loss=learning.sparse_weight_term(config, [layers[n] for n in names]),
            before_step=learning.schedules(config, masks, training.steps),
            finish=lambda: _finish_block(config, names, layers, masks, accumulators, logits, hooks),
            masks=list(masks.values()),
            tune=(lambda: _tune(config, names, layers, logits)) if scope.tune_steps else None,
        )

    result = learn_blockwise(
        model,
        train_data,
        layers,
        start_block,
        TrainConfig.from_options(training),
        make_accumulator=hessian,
        device=device or next(model.parameters()).device,
        checkpoints=Checkpoints.of(config),
    )
    final = hard_perplexity(model, eval_data)
    return Stats(
        tensors={f"{n}.logits": t for n, t in logits.items()},
        meta={
            "history": [],
            "block_history": result.histories,
            "evals": [{"step": training.steps, **final}] if final else [],
            "step0": {},
            "layer_errors": {r.name: r.rel_error for r in result.reports},
            "peak_state_bytes": result.loop.peak_state_bytes,
            "trainable_elements_per_process": held,
            "seconds": result.seconds,
        },
    )
