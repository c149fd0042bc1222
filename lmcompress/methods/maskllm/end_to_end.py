"""MaskLLM end to end (the paper): every selected linear gets learnable N:M mask logits (shifted
by a one-shot prior), trained together on the LM loss with the shared trainer (weights frozen),
optionally under ``accelerate`` (data parallel, or the logits sharded with FSDP).

Loss (paper Sec. 3.4): ``LM loss − λ (1 − step/steps) Σ ‖W ⊙ mask‖²``; with ``weight_reg_norm``
the sum is divided by the layers' total ``Σ ‖W‖²`` (a kept-mass fraction in [0, 1]), so λ no
longer depends on the model's size: at λ = 1e-5 the raw term (~14 on SmolLM2) outweighs the LM
loss (~3).
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn
from torch.nn.utils import parametrize

from lmcompress.compressor.method import Stats
from lmcompress.compressor.model.loss import distillation_losses, final_hidden, nll_from_hidden
from lmcompress.compressor.model.surgery import weight_matrix
from lmcompress.compressor.training import distributed
from lmcompress.compressor.training.drivers import hard_perplexity
from lmcompress.compressor.training.trainer import TrainConfig, Trainer
from lmcompress.compressor.util import memory
from lmcompress.errors import LmcompressError
from lmcompress.methods.maskllm import learning
from lmcompress.methods.maskllm.config import MaskLLMConfig
from lmcompress.methods.maskllm.parametrization import LearnableNMMask
from lmcompress.methods.maskllm.transfer import learned_prior_masks
from lmcompress.methods.priors import one_shot_prior_masks
from lmcompress.methods.sparsegpt.refit import refit

logger = logging.getLogger(__name__)

# Every soft mask, gradient and AdamW moment of the whole model is live at once, and the heap
# would otherwise keep ~1 GB of freed step temporaries (compressor.memory): glibc serves
# allocations of 1 MiB and more with mmap while training end to end.
MMAP_THRESHOLD = 1 << 20


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


def _loss_fn(config: MaskLLMConfig, masks: dict[str, LearnableNMMask], layers, total_mass):
    """``loss_fn(model, ids, step)`` for the trainer: LM loss minus the decaying sparse-weight
    term, plus KL(dense model || masked model) with ``distill``, both computed from the final
    hidden states in chunks of positions (``compressor.lm_loss``)."""
    steps = config.training.steps

    def loss_fn(model: nn.Module, ids: torch.Tensor, step: int):
        teacher = None
        if config.distill:
            with torch.no_grad():
                for mask in masks.values():
                    mask.enabled = False
                teacher = final_hidden(model, ids)  # (B, T, H)
                for mask in masks.values():
                    mask.enabled = True
        # one Gumbel sample per layer for forward and regulariser; losses over the vocabulary
        # a chunk of positions at a time (the (B, T, V) logits never exist whole)
        with parametrize.cached():
            hidden = final_hidden(model, ids)  # (B, T, H)
            reg = sum(weight_matrix(m).square().sum() for m in layers.values())
            if teacher is None:
                lm_loss, kl = nll_from_hidden(model, hidden, ids, reduction="mean"), None
            else:
                lm_loss, kl = distillation_losses(model, hidden, ids, teacher)
        if config.weight_reg_norm:
            reg = reg / total_mass
        loss = lm_loss - config.weight_reg * (1 - step / steps) * reg
        logs = {"lm_loss": float(lm_loss.detach()), "reg": float(reg.detach())}
        if kl is not None:
            loss = loss + kl
            logs["kl"] = float(kl.detach())
        return loss, logs

    return loss_fn


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
    model_device = next(model.parameters()).device
    accelerator = distributed.accelerator(model_device)  # joins the processes, if several
    if training.fsdp and accelerator is not None:  # each process keeps 1/world of the logits
        distributed.shard_modules(masks.values(), model_device)
    elif training.fsdp:
        logger.info("fsdp: a single process, nothing to shard")
    held = sum(distributed.local_tensor(m.logits).numel() for m in masks.values())
    total_mass = sum(float(weight_matrix(m).detach().square().sum()) for m in layers.values())
    trainer = Trainer(
        model,
        {n: m.logits for n, m in masks.items()},
        TrainConfig.from_options(training, mmap_threshold=MMAP_THRESHOLD),
        _loss_fn(config, masks, layers, total_mass),
        before_step=learning.schedules(config, masks, training.steps),
        evaluate=(lambda _step: hard_perplexity(model, eval_data, masks.values()))
        if eval_data is not None
        else None,
        checkpoint_dir=training.checkpoint_dir,
        accelerator=accelerator,
    )
    torch.manual_seed(training.train_seed)  # the Gumbel noise comes from the global RNG
    prior_eval = hard_perplexity(model, eval_data, masks.values())
    model.train(False)  # no dropout: the masks are what is learned
    state = trainer.fit(train_data, resume=training.resume)
    if state.step < training.steps:
        raise LmcompressError(f"training stopped at step {state.step} of {training.steps}")
    del trainer  # the AdamW moments: 2x the logits, no longer needed
    memory.release_free_memory()
    # the whole logits (gathered under FSDP); the parametrizations, which hold the trained
    # ones, are removed in ``apply``, so no copy is needed
    logits = {n: distributed.full_tensor(m.logits.detach()) for n, m in masks.items()}
    meta = {
        "history": state.history,
        "evals": state.evals,
        "step0": prior_eval,
        "trainable_elements_per_process": held,
    }
    if config.scope.refit != "none":
        for module in layers.values():  # back to the original dense weights
            parametrize.remove_parametrizations(module, "weight", leave_parametrized=False)
        keeps = {n: learning.keep_mask(config, n, layers[n], logits[n]) for n in layers}
        meta["layer_errors"] = refit(config, model, train_data, layers, keeps, compute)
        meta["evals"] = meta["evals"] + [
            {
                "step": training.steps,
                "refit": config.scope.refit,
                **hard_perplexity(model, eval_data),
            }
        ]
    meta["seconds"] = time.perf_counter() - start
    return Stats(tensors={f"{n}.logits": t for n, t in logits.items()}, meta=meta)
