"""Stochastic subnetwork extraction on a Hugging Face model: parametrize every selected linear
with per-weight keep logits and a learned scale, learn them with the shared drivers
(``compressor.training.drivers``: end to end on the LM loss, or block by block on the
block-output error), then extract the subnetwork with the scale folded into the kept weights."""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from lmcompress.compressor.method import Stats
from lmcompress.compressor.model.budget import backward_bytes
from lmcompress.compressor.model.structure import block_shapes, structures_of
from lmcompress.compressor.model.surgery import weight_matrix
from lmcompress.compressor.report import CompressionReport, LayerReport
from lmcompress.compressor.training import distributed
from lmcompress.compressor.training.checkpoint import Checkpoints, check_resume
from lmcompress.compressor.training.drivers import (
    MMAP_THRESHOLD,
    Learnable,
    blockwise_estimate,
    learn_blockwise,
    learn_end_to_end,
    training_extra,
)
from lmcompress.compressor.training.trainer import TrainConfig
from lmcompress.compressor.training.tuning import tune_kept_weights
from lmcompress.errors import ConfigError
from lmcompress.methods.common import (
    count_params,
    hard_perplexity,
    held_out_perplexity,
    prune_layer_,
)
from lmcompress.methods.priors import (
    ONE_SHOT_PRIORS,
    one_shot_prior_masks,
)
from lmcompress.methods.pruning import PruningMethod
from lmcompress.methods.sparsegpt import refit
from lmcompress.methods.structured.method import extract_report
from lmcompress.methods.structured.scores import allocate
from lmcompress.methods.subnet import structured
from lmcompress.methods.subnet.config import SubnetConfig
from lmcompress.methods.subnet.learning import (
    dense_keep,
    extract_layer,
    keep_of,
    learnable,
    new_mask,
)
from lmcompress.methods.subnet.parametrization import KeepLogitMask

logger = logging.getLogger(__name__)

CURVE_KEYS = ("step", "loss", "lm_loss", "rel_err", "keep_dev", "lambda")


class Subnet(PruningMethod):
    config_class = SubnetConfig

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # layers ``calibrate`` already extracted (block-wise, or re-fitted), by module identity:
        # ``apply`` on that model reports them as they are, a fresh model is extracted
        self._extracted: dict[int, LayerReport] = {}

    def _split(self, data: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        if data is None:
            raise ConfigError("subnet needs training text (calibration windows)")
        held = min(self.config.training.eval_windows, data.shape[0] - 1)
        return (data[:-held], data[-held:]) if held > 0 else (data, None)

    def _train_config(self, **overrides) -> TrainConfig:
        # the paper: no weight decay on the logits, no gradient clipping
        return TrainConfig.from_options(
            self.config.training, weight_decay=0.0, grad_clip=0.0, **overrides
        )

    def validate(self, model: nn.Module) -> dict[str, nn.Module]:
        """Also ``--resume``'s checkpoints: there, and of the same options."""
        check_resume(self.config)
        if self.config.structure:  # whole structures: the family's, at a budget it can meet
            structures_of(model, self.config.structure)
            ratio = 1.0 - self.config.sparsity.ratio
            allocate(block_shapes(model), self.config.structure, ratio,
                     channel_multiple=self.config.channel_multiple)  # fmt: skip
            return self.select(model)  # every decoder linear: no --include / --exclude here
        return super().validate(model)

    def memory_estimate(
        self, model: nn.Module, nsamples: int, seq_len: int, itemsize: int = 4
    ) -> dict[str, int]:
        """Per layer: fp32 logits, their gradient and up to two optimiser moments, and the
        weight-sized sample and masked weight kept for backward; end to end, the activations
        for backward; block-wise, the loop's windows twice (inputs and dense targets)."""
        layers = self.validate(model)
        training = self.config.training
        activations = backward_bytes(model, training.batch_size, seq_len, itemsize, 3)
        if self.config.structure:  # a logit per structure: nothing beside the activations
            estimate = {"activations kept for backward": activations}
            if self.config.distill_steps:  # W + Δ: fp32 deltas, their gradients, AdamW moments
                numel = sum(weight_matrix(m).numel() for m in layers.values())
                estimate["distillation deltas, gradients and moments"] = 4 * 4 * numel
            return estimate

        def state(module: nn.Module) -> int:
            numel = weight_matrix(module).numel()
            return 4 * 4 * numel + 3 * numel * itemsize

        if self.config.scope.blockwise:
            return blockwise_estimate(
                model, layers, nsamples, seq_len, training.batch_size, itemsize,
                state={"keep logits, gradients and moments": state},
            )  # fmt: skip
        return {
            "keep logits, gradients and moments": sum(state(m) for m in layers.values()),
            "activations kept for backward": activations,
        }

    def calibrate(self, model: nn.Module, data: torch.Tensor | None) -> Stats:
        train_data, eval_data = self._split(data)
        layers = self.validate(model)
        device = self.device or next(model.parameters()).device
        torch.manual_seed(self.config.training.train_seed)  # the noise: the global RNG
        if self.config.structure:
            start = time.perf_counter()
            score = held_out_perplexity(model, eval_data)
            tensors, meta = structured.learn(self.config, model, layers, train_data, score)
            return Stats(tensors=tensors, meta={**meta, "seconds": time.perf_counter() - start})
        if self.config.scope.blockwise:
            return self._blockwise(model, train_data, eval_data, layers, device)
        return self._end_to_end(model, train_data, eval_data, layers, device)

    def _end_to_end(self, model, train_data, eval_data, layers, device) -> Stats:
        config = self.config
        start = time.perf_counter()
        priors = (
            one_shot_prior_masks(
                model, train_data, layers, config.prior, config.sparsity_of, device
            )
            if config.prior != "none"
            else {}
        )
        masks = {n: new_mask(config, n, m, priors.get(n)) for n, m in layers.items()}
        del priors
        result = learn_end_to_end(
            model,
            train_data,
            learnable(config, masks, config.training.steps),
            self._train_config(mmap_threshold=MMAP_THRESHOLD),
            score=held_out_perplexity(model, eval_data),
            checkpoints=Checkpoints.of(config),
            accelerator=distributed.accelerator(next(model.parameters()).device),
        )
        tensors = _learned_tensors(masks)
        state = result.state
        meta = {"history": state.history, "evals": state.evals, "step0": result.step0}
        if config.scope.refit != "none":
            keeps = {  # the frozen dense weights back, re-fitted under the extracted masks
                n: dense_keep(config, n, m, tensors[f"{n}.logits"]) for n, m in layers.items()
            }
            meta["layer_errors"] = refit.refit(config, model, train_data, layers, keeps, device)
            for name, module in layers.items():
                self._extracted[id(module)] = _as_is(config, name, module)
        meta.update(refit=config.scope.refit != "none", seconds=time.perf_counter() - start)
        return Stats(tensors=tensors, meta=meta)

    def _blockwise(self, model, train_data, eval_data, layers, device) -> Stats:
        config, training = self.config, self.config.training
        prior = ONE_SHOT_PRIORS.get(config.prior)
        tensors: dict[str, torch.Tensor] = {}

        def start_block(_index, names, accumulators) -> Learnable:
            masks = {}
            for n in names:
                keep = None
                if prior is not None:
                    W = weight_matrix(layers[n]).detach()
                    H = accumulators[n].H
                    keep = prior.mask(W, prior.from_hessian(H), config.sparsity_of(n))
                masks[n] = new_mask(config, n, layers[n], keep)
            trained = learnable(config, masks, training.steps)

            def finish() -> list[LayerReport]:
                reports = []
                learned = _learned_tensors(masks)
                tensors.update(learned)
                for n in names:
                    started = time.perf_counter()
                    logits = learned[f"{n}.logits"]
                    if config.scope.refit != "none":
                        keep = dense_keep(config, n, layers[n], logits)
                        H = accumulators[n].H
                        report = refit.refit_layer(config, n, layers[n], H, keep)
                    else:
                        scale = learned.get(f"{n}.scale")
                        report = extract_layer(config, n, layers[n], logits, scale)
                    report.seconds = time.perf_counter() - started
                    self._extracted[id(layers[n])] = report
                    reports.append(report)
                return reports

            trained.finish = finish
            if config.scope.tune_steps:  # then the kept weights, the extracted masks fixed
                trained.tune = lambda: _tune(config, {n: layers[n] for n in names}, tensors)
            return trained

        result = learn_blockwise(
            model,
            train_data,
            layers,
            start_block,
            self._train_config(),
            make_accumulator=refit.hessian,
            device=device,
            checkpoints=Checkpoints.of(config),
        )
        final = hard_perplexity(model, eval_data)
        return Stats(
            tensors=tensors,
            meta={
                "block_history": result.histories,
                "evals": [{"step": training.steps, **final}] if final else [],
                "layer_errors": {r.name: r.rel_error for r in result.reports},
                "refit": config.scope.refit != "none",
                "extracted": True,
                "seconds": result.seconds,
            },
        )

    def apply(self, model: nn.Module, stats: Stats) -> CompressionReport:
        """Extract every layer from the learned logits in ``stats`` (works on a fresh model
        too), the scale folded in; layers already extracted in ``calibrate`` (block-wise) or
        re-fitted are kept as they are."""
        start = time.perf_counter()
        layers = self.validate(model)
        if self.config.structure:
            return self._apply_structure(model, stats, start)
        report = CompressionReport(
            self.name, self.config.to_dict(), model_params=count_params(model)
        )
        refit = stats.meta.get("refit", False)
        errors = stats.meta.get("layer_errors", {})
        if refit and not self._extracted:
            logger.warning("subnet: the re-fitted weights live in the calibrated model only")
        for name, module in layers.items():
            if id(module) in self._extracted:
                layer = self._extracted[id(module)]
            else:
                scale = None if refit else stats.tensors.get(f"{name}.scale")
                layer = extract_layer(
                    self.config, name, module, stats.tensors[f"{name}.logits"], scale
                )
            if name in errors:
                layer.rel_error, layer.error_kind = errors[name], "output"
            report.layers.append(layer)
        report.seconds = stats.meta.get("seconds", 0.0) + time.perf_counter() - start
        report.extra = training_extra(stats.meta, CURVE_KEYS)
        kept = sum(r.params_kept for r in report.layers)
        report.extra["sparsity"] = 1.0 - kept / max(sum(r.params for r in report.layers), 1)
        logger.info(
            "subnet: %d steps, sparsity %.4f, hard ppl %s",
            report.extra["steps"], report.extra["sparsity"], report.extra["hard_ppl"],
        )  # fmt: skip
        return report

    def _apply_structure(self, model: nn.Module, stats: Stats, start: float) -> CompressionReport:
        """Extract the learned structures (``<kind>.keep``), their scales folded in."""
        kinds = self.config.structure
        keep = {k: stats.tensors[f"{k}.keep"] for k in kinds}
        scales = {k: stats.tensors[f"{k}.scale"] for k in kinds if f"{k}.scale" in stats.tensors}
        uniform = self.config.widths == "uniform"
        report = extract_report(self, model, keep, scales, stats, start, uniform)
        report.extra.update(training_extra(stats.meta, CURVE_KEYS))
        report.seconds += stats.meta.get("seconds", 0.0)
        return report

    def stats_bytes(self, model: nn.Module) -> int:
        """The fp32 keep logits (one per weight, or per structure) and scales, kept in the
        export."""
        if self.config.structure:  # logits, scales and keeps: a few per channel of each block
            shapes = block_shapes(model)
            return 12 * len(shapes) * (shapes[0].channels + shapes[0].groups + 2)
        return sum(4 * weight_matrix(m).numel() for m in self.validate(model).values())


def _tune(
    config: SubnetConfig, layers: dict[str, nn.Module], learned: dict[str, torch.Tensor]
) -> Learnable:
    """The second training of an extracted block (``--tune-steps``): its kept weights under the
    extracted masks (``training.tuning``)."""
    keeps = {n: keep_of(config, n, learned[f"{n}.logits"]) for n in layers}
    scope = config.scope
    return tune_kept_weights(layers, keeps, scope.tune_steps, scope.tune_lr)


def _as_is(config: SubnetConfig, name: str, module: nn.Module) -> LayerReport:
    """The report of a layer already extracted (its zeros are its mask)."""
    keep = weight_matrix(module).detach() != 0
    return prune_layer_(name, module, keep, config.sparsity_of(name), time.perf_counter())


def _learned_tensors(masks: dict[str, KeepLogitMask]) -> dict[str, torch.Tensor]:
    out = {}
    for name, mask in masks.items():
        out[f"{name}.logits"] = distributed.full_tensor(mask.logits.detach()).cpu().clone()
        if mask.scale is not None:
            out[f"{name}.scale"] = mask.scale.detach().cpu().clone()
    return out
