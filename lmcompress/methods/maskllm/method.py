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
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn
from torch.nn.utils import parametrize
from transformers.pytorch_utils import Conv1D

from lmcompress.compressor import distributed, memory
from lmcompress.compressor.config import Sparsity
from lmcompress.compressor.export import STATS
from lmcompress.compressor.layerwise import compress_layerwise
from lmcompress.compressor.method import Stats
from lmcompress.compressor.report import CompressionReport, LayerReport
from lmcompress.compressor.sparsity import nm_mask
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
from lmcompress.methods.sparsegpt.method import output_error
from lmcompress.methods.sparsegpt.solver import HessianAccumulator, sparsegpt_prune
from lmcompress.methods.wanda.scores import wanda_mask

logger = logging.getLogger(__name__)


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

    def _new_mask(
        self, name: str, module: nn.Module, prior: torch.Tensor | None, generator: torch.Generator
    ) -> LearnableNMMask:
        """Logits N(0, init_std²) for ``module``'s groups, shifted by the prior keep-mask (if
        any), as a parametrization of its weight."""
        config = self.config
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

    def _schedules(self, masks: dict[str, LearnableNMMask], steps: int):
        """``before_step(step)`` for the trainer: sets τ, κ and straight-through on every mask
        and logs them with the fraction of groups whose argmax changed since the last step."""
        config = self.config

        def argmax(mask: LearnableNMMask) -> torch.Tensor:  # small ints: 1 byte for 2:4
            small = torch.uint8 if mask.logits.shape[-1] <= 256 else torch.int32
            # this process's groups only, under FSDP (the counts are summed over processes)
            return distributed.local_tensor(mask.logits.detach()).argmax(-1).to(small)

        last_argmax = {n: argmax(m) for n, m in masks.items()}

        def before_step(step: int) -> dict[str, float]:
            tau = linear_schedule(*config.tau, step, steps)
            kappa = linear_schedule(*config.kappa, step, steps)
            straight = (
                step >= config.straight_through_from * steps and config.straight_through_from < 1
            )
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

    def _train_config(
        self, steps: int, batch_size: int, seed: int, mmap_threshold: int = 0
    ) -> TrainConfig:
        config = self.config
        return TrainConfig(
            steps=steps,
            lr=config.lr,
            batch_size=batch_size,
            grad_accum=config.grad_accum,
            eval_every=config.eval_every,
            seed=seed,
            checkpoint_every=config.checkpoint_every,
            warmup_steps=config.warmup_steps,
            bf16=config.bf16,
            mmap_threshold=mmap_threshold,
        )

    def _eval_hard(self, model: nn.Module, eval_data: torch.Tensor | None, masks=()) -> dict:
        """Perplexity of the argmax masks on the held-out windows (``{}`` without any)."""
        if eval_data is None:
            return {}
        for mask in masks:
            mask.hard = True
        try:
            result = perplexity(model, eval_data.flatten(), eval_data.shape[1], progress=False)
        finally:
            for mask in masks:
                mask.hard = False
        return {"hard_ppl": result.perplexity}

    def _split(self, data: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        if data is None:
            raise ConfigError("maskllm needs training text (calibration windows)")
        held = min(self.config.eval_windows, data.shape[0] - 1)
        return (data[:-held], data[-held:]) if held > 0 else (data, None)

    def calibrate(self, model: nn.Module, data: torch.Tensor | None) -> Stats:
        if self.config.blockwise:
            return self._calibrate_blockwise(model, data)
        return self._calibrate_end_to_end(model, data)

    # --- end to end (the paper) -------------------------------------------------------------

    def _calibrate_end_to_end(self, model: nn.Module, data: torch.Tensor | None) -> Stats:
        config = self.config
        train_data, eval_data = self._split(data)
        start = time.perf_counter()
        layers = self.validate(model)
        priors = self.prior_masks(model, train_data, layers)

        generator = torch.Generator().manual_seed(config.train_seed)
        masks = {
            name: self._new_mask(name, module, priors.get(name), generator)
            for name, module in layers.items()
        }
        for param in model.parameters():
            param.requires_grad_(False)
        for mask in masks.values():
            mask.logits.requires_grad_(True)
        device = next(model.parameters()).device
        accelerator = distributed.accelerator(device)  # joins the processes, if several
        if config.fsdp and accelerator is not None:  # each process keeps 1/world of the logits
            distributed.shard_modules(masks.values(), device)
        elif config.fsdp:
            logger.info("fsdp: a single process, nothing to shard")
        total_mass = sum(float(weight_matrix(m).detach().square().sum()) for m in layers.values())

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

        trainer = Trainer(
            model,
            {n: m.logits for n, m in masks.items()},
            # 1 MiB: every soft mask, gradient and AdamW moment of the whole model is live at once,
            # and the heap would otherwise keep ~1 GB of freed step temporaries (compressor.memory)
            self._train_config(config.steps, config.batch_size, config.train_seed, 1 << 20),
            loss_fn,
            before_step=self._schedules(masks, config.steps),
            evaluate=(lambda _step: self._eval_hard(model, eval_data, masks.values()))
            if eval_data is not None
            else None,
            checkpoint_dir=config.checkpoint_dir,
            accelerator=accelerator,
        )
        torch.manual_seed(config.train_seed)  # the Gumbel noise comes from the global RNG
        prior_eval = self._eval_hard(model, eval_data, masks.values())
        model.train(False)  # no dropout: the masks are what is learned
        state = trainer.fit(train_data, resume=config.resume)
        if state.step < config.steps:
            raise LmcompressError(f"training stopped at step {state.step} of {config.steps}")
        del trainer  # the AdamW moments: 2x the logits, no longer needed
        memory.release_free_memory()
        # the whole logits (gathered under FSDP); the parametrizations, which hold the
        # trained ones, are removed in ``apply``, so no copy is needed
        logits = {n: distributed.full_tensor(m.logits.detach()) for n, m in masks.items()}
        meta = {"history": state.history, "evals": state.evals, "step0": prior_eval}
        if config.refit != "none":
            for module in layers.values():  # back to the original dense weights
                parametrize.remove_parametrizations(module, "weight", leave_parametrized=False)
            keeps = {n: self._keep(n, layers[n], logits[n]) for n in layers}
            errors = self._refit(model, train_data, layers, keeps)
            meta["layer_errors"] = errors
            meta["evals"] = meta["evals"] + [
                {"step": config.steps, "refit": config.refit, **self._eval_hard(model, eval_data)}
            ]
        meta["seconds"] = time.perf_counter() - start
        return Stats(tensors={f"{n}.logits": t for n, t in logits.items()}, meta=meta)

    # --- weight re-fitting ------------------------------------------------------------------

    def _keep(self, name: str, module: nn.Module, logits: torch.Tensor) -> torch.Tensor:
        """The argmax keep-mask of ``logits``, bool (out, in)."""
        sparsity = self.config.sparsity_of(name)
        keep = hard_mask(logits.detach().cpu(), candidate_patterns(sparsity.n, sparsity.m))
        return keep.reshape(weight_matrix(module).shape).bool()

    @torch.no_grad()
    def _refit_layer(
        self, name: str, module: nn.Module, H: torch.Tensor, keep: torch.Tensor
    ) -> LayerReport:
        """SparseGPT's OBS updates with the mask fixed to ``keep``: re-fit the kept weights."""
        start = time.perf_counter()
        sparsity = self.config.sparsity_of(name)
        W = weight_matrix(module).detach()
        W_new, keep = sparsegpt_prune(W, H, sparsity, mask=keep.to(W.device))
        error = output_error(W, W_new, H)
        report = prune_layer_(name, module, keep, sparsity, start, new_weight=W_new)
        report.rel_error, report.error_kind = error, "output"
        return report

    def _refit(
        self,
        model: nn.Module,
        data: torch.Tensor,
        layers: dict[str, nn.Module],
        keeps: dict[str, torch.Tensor],
    ) -> dict[str, float]:
        """Re-fit every layer to its mask through the layer-wise loop (each block sees the
        re-fitted blocks before it, as SparseGPT does). Returns relative output errors."""
        reports, _ = compress_layerwise(
            model,
            data,
            layers,
            make_accumulator=self._hessian,
            compress_layer=lambda n, m, acc: self._refit_layer(n, m, acc.H, keeps[n]),
            device=self.device or next(model.parameters()).device,
            batch_size=8,
        )
        return {r.name: r.rel_error for r in reports}

    @staticmethod
    def _hessian(name: str, module: nn.Module) -> HessianAccumulator:  # noqa: ARG004
        W = weight_matrix(module)
        return HessianAccumulator(W.shape[1], device=W.device)

    # --- block-wise (beyond the paper) ------------------------------------------------------

    def _block_prior(
        self, name: str, module: nn.Module, H: torch.Tensor, loaded: dict[str, torch.Tensor]
    ) -> torch.Tensor | None:
        """The prior keep-mask of one layer from its Hessian on the compressed inputs."""
        config = self.config
        if config.prior_from:
            return loaded[name]
        sparsity: Sparsity = config.sparsity_of(name)
        W = weight_matrix(module).detach()
        if config.prior == "sparsegpt":
            return sparsegpt_prune(W, H, sparsity, update_weights=False)[1]
        if config.prior == "wanda":  # ‖X_j‖ ∝ sqrt(H_jj)
            return wanda_mask(W, H.diagonal().clamp_min(0).sqrt(), sparsity)
        if config.prior == "magnitude":
            return nm_mask(W.abs(), sparsity.n, sparsity.m)
        return None

    def _calibrate_blockwise(self, model: nn.Module, data: torch.Tensor | None) -> Stats:
        config = self.config
        train_data, eval_data = self._split(data)
        start = time.perf_counter()
        layers = self.validate(model)
        loaded = self.prior_masks(model, train_data, layers) if config.prior_from else {}
        generator = torch.Generator().manual_seed(config.train_seed)
        torch.manual_seed(config.train_seed)  # the Gumbel noise comes from the global RNG
        dense: list[torch.Tensor] = []  # the dense model's hidden states entering the block
        logits: dict[str, torch.Tensor] = {}
        block_history: list[dict] = []

        def compress_block(index, block, names, accumulators, batches) -> list[LayerReport]:
            if not dense:
                dense.extend(b["hidden"] for b in batches)

            def run(x: torch.Tensor, b: dict) -> torch.Tensor:
                out = block(x, *b["args"][index], **b["kwargs"][index])
                return out[0] if isinstance(out, (tuple, list)) else out

            targets = [
                run(x, b) for x, b in zip(dense, batches, strict=True)
            ]  # dense block, dense inputs
            scales = [
                (y - x).square().mean().clamp_min(1e-12)
                for x, y in zip(dense, targets, strict=True)
            ]
            masks = {
                n: self._new_mask(
                    n,
                    layers[n],
                    self._block_prior(n, layers[n], accumulators[n].H, loaded),
                    generator,
                )
                for n in names
            }
            params = list(block.parameters())
            grad_before = [p.requires_grad for p in params]
            for p in params:
                p.requires_grad_(False)
            for mask in masks.values():
                mask.logits.requires_grad_(True)
            mass = sum(float(weight_matrix(layers[n]).detach().square().sum()) for n in names)

            def loss_fn(_block: nn.Module, ids: torch.Tensor, step: int):
                k = int(ids[0, 0])
                with parametrize.cached():
                    out = run(batches[k]["hidden"], batches[k])
                    reg = sum(weight_matrix(layers[n]).square().sum() for n in names)
                err = (out.float() - targets[k].float()).square().mean() / scales[k]
                if config.weight_reg_norm:
                    reg = reg / mass
                loss = err - config.weight_reg * (1 - step / config.steps) * reg
                return loss, {"rel_err": float(err.detach()), "reg": float(reg.detach())}

            trainer = Trainer(
                block,
                {n: m.logits for n, m in masks.items()},
                self._train_config(config.steps, 1, config.train_seed + index),
                loss_fn,
                before_step=self._schedules(masks, config.steps),
                desc=f"block {index}",
                leave=False,
            )
            with torch.enable_grad():
                state = trainer.fit(torch.arange(len(batches))[:, None])
            for p, flag in zip(params, grad_before, strict=True):
                p.requires_grad_(flag)
            block_history.append({"block": index, "history": state.history})
            reports = []
            for n in names:
                logits[n] = masks[n].logits.detach().cpu().clone()
                parametrize.remove_parametrizations(layers[n], "weight", leave_parametrized=False)
                keep = self._keep(n, layers[n], logits[n])
                if config.refit == "sparsegpt":
                    reports.append(self._refit_layer(n, layers[n], accumulators[n].H, keep))
                else:
                    sparsity = config.sparsity_of(n)
                    reports.append(prune_layer_(n, layers[n], keep, sparsity, time.perf_counter()))
            dense[:] = targets
            return reports

        reports, loop = compress_layerwise(
            model,
            train_data,
            layers,
            make_accumulator=self._hessian,
            device=self.device or next(model.parameters()).device,
            batch_size=config.batch_size,
            compress_block=compress_block,
        )
        model.train(False)
        final = self._eval_hard(model, eval_data)
        return Stats(
            tensors={f"{n}.logits": t for n, t in logits.items()},
            meta={
                "history": [],
                "block_history": block_history,
                "evals": [{"step": config.steps, **final}] if final else [],
                "step0": {},
                "layer_errors": {r.name: r.rel_error for r in reports},
                "peak_state_bytes": loop.peak_state_bytes,
                "seconds": time.perf_counter() - start,
            },
        )

    def apply(self, model: nn.Module, stats: Stats) -> CompressionReport:
        """Keep each layer's argmax mask (from ``stats``: works on a fresh model too; weights
        re-fitted by ``refit`` live in the model that was calibrated, not in ``stats``)."""
        start = time.perf_counter()
        layers = self.validate(model)
        report = CompressionReport(
            self.name, self.config.to_dict(), model_params=count_params(model)
        )
        errors = stats.meta.get("layer_errors", {})
        for name, module in layers.items():
            layer_start = time.perf_counter()
            if parametrize.is_parametrized(module, "weight"):
                parametrize.remove_parametrizations(module, "weight", leave_parametrized=False)
            keep = self._keep(name, module, stats.tensors[f"{name}.logits"])
            layer = prune_layer_(name, module, keep, self.config.sparsity_of(name), layer_start)
            if name in errors:  # the error against the dense weights, measured in calibrate
                layer.rel_error, layer.error_kind = errors[name], "output"
            report.layers.append(layer)
        for param in model.parameters():
            param.requires_grad_(True)
        report.seconds = stats.meta.get("seconds", 0.0) + time.perf_counter() - start
        keys = ("step", "loss", "lm_loss", "rel_err", "tau", "kappa", "flipped")
        history = stats.meta.get("history", [])
        blocks = stats.meta.get("block_history", [])
        report.extra = {
            "loss_curve": [{k: h[k] for k in keys if k in h} for h in history],
            "hard_ppl": [{"step": 0, **stats.meta["step0"]}] * bool(stats.meta.get("step0"))
            + stats.meta.get("evals", []),
            "steps": len(history) or max((len(b["history"]) for b in blocks), default=0),
        }
        if blocks:
            report.extra["block_curves"] = [
                {
                    "block": b["block"],
                    "curve": [{k: h[k] for k in keys if k in h} for h in b["history"]],
                }
                for b in blocks
            ]
        logger.info(
            "maskllm: %d steps, hard-mask ppl %s", report.extra["steps"], report.extra["hard_ppl"]
        )
        return report
