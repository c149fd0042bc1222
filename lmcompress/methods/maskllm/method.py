"""MaskLLM on a Hugging Face model: parametrize every selected linear with learnable N:M mask
logits, learn them with the shared trainer (weights frozen), then keep the argmax masks.

Two drivers learn the logits: ``end_to_end`` (the paper: the whole model on the LM loss) and
``blockwise`` (one decoder block at a time inside the layer-wise loop, matching the dense
model's block outputs); ``priors`` gives the masks they start from.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn.utils import parametrize

from lmcompress.compressor.calibration.layerwise import layerwise_estimate
from lmcompress.compressor.io.layout import STATS
from lmcompress.compressor.method import Stats
from lmcompress.compressor.model.budget import backward_bytes
from lmcompress.compressor.model.surgery import weight_matrix
from lmcompress.compressor.report import CompressionReport

# ``distributed`` is reached as ``maskllm.method.distributed`` by tests that spy on the
# sharding of the logits (``shard_modules``)
from lmcompress.compressor.training import distributed  # noqa: F401
from lmcompress.compressor.training.checkpoint import check_resume
from lmcompress.compressor.training.drivers import blockwise_estimate, training_extra
from lmcompress.errors import ConfigError
from lmcompress.methods.common import count_params, prune_layer_
from lmcompress.methods.maskllm.blockwise import calibrate_blockwise
from lmcompress.methods.maskllm.config import MaskLLMConfig
from lmcompress.methods.maskllm.end_to_end import calibrate_end_to_end
from lmcompress.methods.maskllm.learning import keep_mask
from lmcompress.methods.priors import PRIOR_BATCH_SIZE
from lmcompress.methods.pruning import PruningMethod

logger = logging.getLogger(__name__)

# per-step entries of the training history that the report keeps
CURVE_KEYS = ("step", "loss", "lm_loss", "rel_err", "tau", "kappa", "flipped")


class MaskLLM(PruningMethod):
    config_class = MaskLLMConfig

    def _split(self, data: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Training windows and the held-out ones the hard-mask perplexity is measured on."""
        if data is None:
            raise ConfigError("maskllm needs training text (calibration windows)")
        held = min(self.config.training.eval_windows, data.shape[0] - 1)
        return (data[:-held], data[-held:]) if held > 0 else (data, None)

    def validate(self, model: nn.Module) -> dict[str, nn.Module]:
        """Also the files this run reads: ``--resume`` needs checkpoints of the same options
        (``checkpoint.check_resume``), ``--prior-from`` a maskllm output directory."""
        layers = super().validate(model)
        check_resume(self.config)
        if self.config.prior_from and not (Path(self.config.prior_from) / STATS).is_file():
            raise ConfigError(
                f"--prior-from {self.config.prior_from}: no {STATS} (not a maskllm output)"
            )
        return layers

    def memory_estimate(
        self, model: nn.Module, nsamples: int, seq_len: int, itemsize: int = 4
    ) -> dict[str, int]:
        """The learned state: per layer, logits over the C(M, N) patterns of every group with
        their gradient and two AdamW moments (fp32), and the weight-sized soft mask and masked
        weight that backward keeps; end to end, every block's activations for backward and the
        logits; block-wise, the layer-wise loop's windows, twice (inputs and dense targets)."""
        layers = self.validate(model)
        if self.config.prior in ("sparsegpt", "wanda"):  # runs first, and is freed before
            prior = layerwise_estimate(
                model,
                layers,
                nsamples,
                seq_len,
                PRIOR_BATCH_SIZE,
                itemsize,
                state={"prior statistics": lambda m: 3 * 4 * weight_matrix(m).shape[1] ** 2},
            )
            prior["weights kept aside by the prior"] = sum(
                weight_matrix(m).numel() * itemsize for m in layers.values()
            )
        else:
            prior = {}
        training_parts = self._training_estimate(model, layers, nsamples, seq_len, itemsize)
        return max(prior, training_parts, key=lambda parts: sum(parts.values()))

    def _training_estimate(
        self,
        model: nn.Module,
        layers: dict[str, nn.Module],
        nsamples: int,
        seq_len: int,
        itemsize: int,
    ) -> dict[str, int]:
        training = self.config.training

        def state(name: str, module: nn.Module) -> int:
            sparsity = self.config.sparsity_of(name)
            numel = weight_matrix(module).numel()
            patterns = math.comb(sparsity.m, sparsity.n)
            return 4 * 4 * numel // sparsity.m * patterns + 2 * numel * itemsize

        if self.config.scope.blockwise:
            names = {id(module): name for name, module in layers.items()}
            return blockwise_estimate(
                model, layers, nsamples, seq_len, training.batch_size, itemsize,
                state={
                    "mask logits, gradients and AdamW moments": lambda m: state(names[id(m)], m)
                },
            )  # fmt: skip
        activations = backward_bytes(
            model, training.batch_size, seq_len, itemsize, 5 if self.config.distill else 3
        )
        return {
            "mask logits, gradients and AdamW moments": sum(
                state(name, module) for name, module in layers.items()
            ),
            "activations kept for backward": activations,
        }

    def calibrate(self, model: nn.Module, data: torch.Tensor | None) -> Stats:
        train_data, eval_data = self._split(data)
        layers = self.validate(model)
        driver = calibrate_blockwise if self.config.scope.blockwise else calibrate_end_to_end
        return driver(self.config, model, train_data, eval_data, layers, self.device)

    def apply(self, model: nn.Module, stats: Stats) -> CompressionReport:
        """Keep each layer's argmax mask (from ``stats``: works on a fresh model too; weights
        re-fitted by ``--refit`` live in the model that was calibrated, not in ``stats``)."""
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
            keep = keep_mask(self.config, name, module, stats.tensors[f"{name}.logits"])
            layer = prune_layer_(name, module, keep, self.config.sparsity_of(name), layer_start)
            if name in errors:  # the error against the dense weights, measured in calibrate
                layer.rel_error, layer.error_kind = errors[name], "output"
            report.layers.append(layer)
        report.seconds = stats.meta.get("seconds", 0.0) + time.perf_counter() - start
        report.extra = training_extra(stats.meta, CURVE_KEYS)
        if "trainable_elements_per_process" in stats.meta:
            report.extra["trainable_elements_per_process"] = stats.meta[
                "trainable_elements_per_process"
            ]
        logger.info(
            "maskllm: %d steps, hard-mask ppl %s", report.extra["steps"], report.extra["hard_ppl"]
        )
        return report

    def stats_bytes(self, model: nn.Module) -> int:
        """The fp32 logits over the C(M, N) patterns of every group, kept in the export."""
        total = 0
        for name, module in self.validate(model).items():
            sparsity = self.config.sparsity_of(name)
            groups = weight_matrix(module).numel() // sparsity.m
            total += 4 * groups * math.comb(sparsity.m, sparsity.n)
        return total
