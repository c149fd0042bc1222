"""MaskLLM on a Hugging Face model: parametrize every selected linear with learnable N:M mask
logits, train the logits end to end (weights frozen) with the shared trainer, then keep the
argmax masks.

Loss (paper Sec. 3.4): ``LM loss − λ (1 − step/steps) Σ ‖W ⊙ mask‖²``; with ``weight_reg_norm``
the sum is divided by the layers' total ``Σ ‖W‖²`` (a kept-mass fraction in [0, 1]), so λ no
longer depends on the model's size: at λ = 1e-5 the raw term (~14 on SmolLM2) outweighs the LM
loss (~3).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn
from torch.nn.utils import parametrize
from transformers.pytorch_utils import Conv1D

from lmcompress.compressor.export import STATS
from lmcompress.compressor.method import Stats
from lmcompress.compressor.report import CompressionReport
from lmcompress.compressor.surgery import add_parametrization, weight_matrix
from lmcompress.compressor.trainer import TrainConfig, Trainer
from lmcompress.errors import ConfigError, LmcompressError
from lmcompress.evaluation.perplexity import perplexity
from lmcompress.methods.common import count_params, prune_layer_
from lmcompress.methods.maskllm.config import MaskLLMConfig
from lmcompress.methods.maskllm.masks import (
    candidate_patterns,
    hard_mask,
    init_logits,
    linear_schedule,
    prior_logits,
)
from lmcompress.methods.maskllm.parametrization import LearnableNMMask
from lmcompress.methods.pruning import PruningMethod

logger = logging.getLogger(__name__)


def _accelerator(model: nn.Module):
    """An ``accelerate.Accelerator`` when launched on several processes (``accelerate launch``),
    else None. The trainer averages the logits' gradients across processes."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    from accelerate import Accelerator

    return Accelerator(cpu=next(model.parameters()).device.type == "cpu")


class MaskLLM(PruningMethod):
    config_class = MaskLLMConfig

    # --- priors ---------------------------------------------------------------------------

    def prior_masks(self, model: nn.Module, data: torch.Tensor, layers: dict[str, nn.Module]):
        """``{layer: keep (out, in) bool}`` of the configured one-shot prior (weights restored)."""
        config = self.config
        if config.prior_from:
            path = Path(config.prior_from) / STATS
            if not path.is_file():
                raise ConfigError(
                    f"--prior-from {config.prior_from}: no {STATS} (not a maskllm output)"
                )
            saved = load_file(str(path))
            masks = {}
            for name, module in layers.items():
                if f"{name}.logits" not in saved:
                    raise ConfigError(f"--prior-from {config.prior_from} has no mask for {name}")
                sparsity = config.sparsity_of(name)
                logits = saved[f"{name}.logits"]
                masks[name] = hard_mask(logits, candidate_patterns(sparsity.n, sparsity.m)).bool()
                masks[name] = masks[name].reshape(weight_matrix(module).shape)
            return masks
        if config.prior == "none":
            return {}
        from lmcompress.api import compress
        from lmcompress.methods import get_method

        originals = {n: weight_matrix(m).detach().clone() for n, m in layers.items()}
        options = {"update_weights": False} if config.prior == "sparsegpt" else {}
        prior_config = get_method(config.prior).config_class(
            sparsity=config.sparsity,
            layer_sparsity=config.layer_sparsity,
            include=config.include,
            exclude=config.exclude,
            **options,
        )
        compress(model, prior_config, data, device=self.device)
        masks = {}
        with torch.no_grad():
            for name, module in layers.items():
                W = weight_matrix(module)
                masks[name] = W != 0
                W.copy_(originals[name])
        return masks

    # --- training -------------------------------------------------------------------------

    def calibrate(self, model: nn.Module, data: torch.Tensor | None) -> Stats:
        config = self.config
        if data is None:
            raise ConfigError("maskllm needs training text (calibration windows)")
        held = min(config.eval_windows, data.shape[0] - 1)
        train_data, eval_data = (data[:-held], data[-held:]) if held > 0 else (data, None)
        start = time.perf_counter()
        layers = self.validate(model)
        priors = self.prior_masks(model, train_data, layers)

        generator = torch.Generator().manual_seed(config.train_seed)
        masks: dict[str, LearnableNMMask] = {}
        for name, module in layers.items():
            sparsity = config.sparsity_of(name)
            W = weight_matrix(module)
            candidates = candidate_patterns(sparsity.n, sparsity.m)
            logits = init_logits(
                W.numel() // sparsity.m, len(candidates), config.init_std, generator
            )
            if name in priors:
                logits = prior_logits(
                    logits, priors[name].reshape(-1, sparsity.m), candidates, config.prior_strength
                )
            masks[name] = LearnableNMMask(
                logits.to(W.device),
                sparsity.n,
                sparsity.m,
                tuple(W.shape),
                transposed=isinstance(module, Conv1D),
            )
            add_parametrization(module, masks[name])
        for param in model.parameters():
            param.requires_grad_(False)
        for mask in masks.values():
            mask.logits.requires_grad_(True)
        total_mass = sum(float(weight_matrix(m).detach().square().sum()) for m in layers.values())
        last_argmax = {n: m.logits.detach().argmax(-1) for n, m in masks.items()}

        def before_step(step: int) -> dict[str, float]:
            tau = linear_schedule(*config.tau, step, config.steps)
            kappa = linear_schedule(*config.kappa, step, config.steps)
            flipped = groups = 0
            for name, mask in masks.items():
                mask.tau, mask.kappa = tau, kappa
                argmax = mask.logits.detach().argmax(-1)
                flipped += int((argmax != last_argmax[name]).sum())
                groups += argmax.numel()
                last_argmax[name] = argmax
            return {"tau": tau, "kappa": kappa, "flipped": flipped / groups}

        def loss_fn(model: nn.Module, ids: torch.Tensor, step: int):
            teacher = None
            if config.distill:
                with torch.no_grad():
                    for mask in masks.values():
                        mask.enabled = False
                    teacher = model(input_ids=ids, use_cache=False).logits
                    for mask in masks.values():
                        mask.enabled = True
            with parametrize.cached():  # one Gumbel sample per layer for forward and regulariser
                out = model(input_ids=ids, labels=ids, use_cache=False)
                reg = sum(weight_matrix(m).square().sum() for m in layers.values())
            if config.weight_reg_norm:
                reg = reg / total_mass
            loss = out.loss - config.weight_reg * (1 - step / config.steps) * reg
            logs = {"lm_loss": float(out.loss.detach()), "reg": float(reg.detach())}
            if teacher is not None:
                kl = F.kl_div(
                    F.log_softmax(out.logits.float(), -1).flatten(0, 1),
                    F.log_softmax(teacher.float(), -1).flatten(0, 1),
                    log_target=True,
                    reduction="batchmean",
                )
                loss = loss + kl
                logs["kl"] = float(kl.detach())
            return loss, logs

        def evaluate(step: int) -> dict[str, float]:  # noqa: ARG001
            for mask in masks.values():
                mask.hard = True
            try:
                result = perplexity(model, eval_data.flatten(), eval_data.shape[1], progress=False)
            finally:
                for mask in masks.values():
                    mask.hard = False
            return {"hard_ppl": result.perplexity}

        train_config = TrainConfig(
            steps=config.steps,
            lr=config.lr,
            batch_size=config.batch_size,
            grad_accum=config.grad_accum,
            eval_every=config.eval_every,
            seed=config.train_seed,
            checkpoint_every=config.checkpoint_every,
        )
        trainer = Trainer(
            model,
            {n: m.logits for n, m in masks.items()},
            train_config,
            loss_fn,
            before_step=before_step,
            evaluate=evaluate if eval_data is not None else None,
            checkpoint_dir=config.checkpoint_dir,
            accelerator=_accelerator(model),
        )
        torch.manual_seed(config.train_seed)  # the Gumbel noise comes from the global RNG
        prior_eval = evaluate(0) if eval_data is not None else {}
        model.train(False)  # no dropout: the masks are what is learned
        state = trainer.fit(train_data, resume=config.resume)
        if state.step < config.steps:
            raise LmcompressError(f"training stopped at step {state.step} of {config.steps}")
        return Stats(
            tensors={f"{n}.logits": m.logits.detach().clone() for n, m in masks.items()},
            meta={
                "history": state.history,
                "evals": state.evals,
                "step0": prior_eval,
                "seconds": time.perf_counter() - start,
            },
        )

    def apply(self, model: nn.Module, stats: Stats) -> CompressionReport:
        """Keep each layer's argmax mask (from ``stats``: works on a fresh model too)."""
        start = time.perf_counter()
        layers = self.validate(model)
        report = CompressionReport(
            self.name, self.config.to_dict(), model_params=count_params(model)
        )
        for name, module in layers.items():
            layer_start = time.perf_counter()
            if parametrize.is_parametrized(module, "weight"):
                parametrize.remove_parametrizations(module, "weight", leave_parametrized=False)
            sparsity = self.config.sparsity_of(name)
            W = weight_matrix(module)
            keep = hard_mask(
                stats.tensors[f"{name}.logits"], candidate_patterns(sparsity.n, sparsity.m)
            )
            report.layers.append(
                prune_layer_(name, module, keep.reshape(W.shape).bool(), sparsity, layer_start)
            )
        for param in model.parameters():
            param.requires_grad_(True)
        report.seconds = stats.meta.get("seconds", 0.0) + time.perf_counter() - start
        history = stats.meta.get("history", [])
        report.extra = {
            "loss_curve": [
                {k: h[k] for k in ("step", "loss", "lm_loss", "tau", "kappa", "flipped") if k in h}
                for h in history
            ],
            "hard_ppl": [{"step": 0, **stats.meta["step0"]}] * bool(stats.meta.get("step0"))
            + stats.meta.get("evals", []),
            "steps": len(history),
        }
        logger.info("maskllm: %d steps, hard-mask ppl %s", len(history), report.extra["hard_ppl"])
        return report
