"""MaskLLM block-wise (beyond the paper): inside the layer-wise loop, block i learns its masks
so that its output matches the dense model's hidden states after block i, from the compressed
model's hidden states entering it. A dense stream runs alongside (earlier blocks' errors are
compensated, not accumulated); ``steps`` are per block, each one block's forward and backward.
The prior comes from the same loop: the one-shot prior's mask from the Hessian it accumulates.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from lmcompress.compressor.layerwise import compress_layerwise
from lmcompress.compressor.method import Stats
from lmcompress.compressor.report import LayerReport
from lmcompress.compressor.surgery import weight_matrix
from lmcompress.compressor.trainer import TrainConfig, Trainer
from lmcompress.methods.common import prune_layer_
from lmcompress.methods.maskllm import learning
from lmcompress.methods.maskllm.config import MaskLLMConfig
from lmcompress.methods.maskllm.priors import ONE_SHOT_PRIORS, learned_prior_masks


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


def _run(block: nn.Module, index: int, x: torch.Tensor, batch: dict[str, Any]) -> torch.Tensor:
    out = block(x, *batch["args"][index], **batch["kwargs"][index])
    return out[0] if isinstance(out, (tuple, list)) else out


def calibrate_blockwise(
    config: MaskLLMConfig,
    model: nn.Module,
    train_data: torch.Tensor,
    eval_data: torch.Tensor | None,
    layers: dict[str, nn.Module],
    device: torch.device | None,
) -> Stats:
    """Learn the masks of ``layers`` block by block; the learned logits are the stats."""
    training = config.training
    start = time.perf_counter()
    loaded = (
        learned_prior_masks(config.prior_from, layers, config.sparsity_of)
        if config.prior_from
        else {}
    )
    generator = torch.Generator().manual_seed(training.train_seed)
    torch.manual_seed(training.train_seed)  # the Gumbel noise comes from the global RNG
    dense: list[torch.Tensor] = []  # the dense model's hidden states entering the block
    logits: dict[str, torch.Tensor] = {}
    block_history: list[dict] = []
    held = 0  # mask-logit elements: one process trains every block's in turn

    def compress_block(index, block, names, accumulators, batches) -> list[LayerReport]:
        nonlocal held
        if not dense:
            dense.extend(b["hidden"] for b in batches)
        # the dense block on the dense inputs: what the compressed block must reproduce
        targets = [_run(block, index, x, b) for x, b in zip(dense, batches, strict=True)]
        scales = [
            (y - x).square().mean().clamp_min(1e-12) for x, y in zip(dense, targets, strict=True)
        ]
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
        mass = sum(float(weight_matrix(layers[n]).detach().square().sum()) for n in names)
        examples = list(zip(batches, targets, scales, strict=True))

        def loss_fn(_block: nn.Module, example: tuple, step: int):
            batch, target, scale = example
            with parametrize.cached():
                out = _run(block, index, batch["hidden"], batch)
                reg = sum(weight_matrix(layers[n]).square().sum() for n in names)
            err = (out.float() - target.float()).square().mean() / scale
            if config.weight_reg_norm:
                reg = reg / mass
            loss = err - config.weight_reg * (1 - step / training.steps) * reg
            return loss, {"rel_err": float(err.detach()), "reg": float(reg.detach())}

        trainer = Trainer(
            block,
            {n: m.logits for n, m in masks.items()},
            # one example is one captured batch of ``batch_size`` windows
            TrainConfig.from_options(training, batch_size=1, seed=training.train_seed + index),
            loss_fn,
            before_step=learning.schedules(config, masks, training.steps),
            desc=f"block {index}",
            leave=False,
            collate=lambda items, idx: items[int(idx[0])],
        )
        with torch.enable_grad():
            state = trainer.fit(examples)
        block_history.append({"block": index, "history": state.history})
        reports = []
        for n in names:
            logits[n] = masks[n].logits.detach().cpu().clone()
            parametrize.remove_parametrizations(layers[n], "weight", leave_parametrized=False)
            keep = learning.keep_mask(config, n, layers[n], logits[n])
            if config.refit == "sparsegpt":
                reports.append(learning.refit_layer(config, n, layers[n], accumulators[n].H, keep))
            else:
                sparsity = config.sparsity_of(n)
                reports.append(prune_layer_(n, layers[n], keep, sparsity, time.perf_counter()))
        dense[:] = targets
        return reports

    reports, loop = compress_layerwise(
        model,
        train_data,
        layers,
        make_accumulator=learning.hessian,
        device=device or next(model.parameters()).device,
        batch_size=training.batch_size,
        compress_block=compress_block,
    )
    model.train(False)
    final = learning.eval_hard(model, eval_data)
    return Stats(
        tensors={f"{n}.logits": t for n, t in logits.items()},
        meta={
            "history": [],
            "block_history": block_history,
            "evals": [{"step": training.steps, **final}] if final else [],
            "step0": {},
            "layer_errors": {r.name: r.rel_error for r in reports},
            "peak_state_bytes": loop.peak_state_bytes,
            "trainable_elements_per_process": held,
            "seconds": time.perf_counter() - start,
        },
    )
