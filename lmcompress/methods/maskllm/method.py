"""MaskLLM on a Hugging Face model: parametrize every selected linear with learnable N:M mask
logits, learn them with the shared trainer (weights frozen), then keep the argmax masks.

Two drivers learn the logits: ``end_to_end`` (the paper: the whole model on the LM loss) and
``blockwise`` (one decoder block at a time inside the layer-wise loop, matching the dense
model's block outputs); ``priors`` gives the masks they start from.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn
from torch.nn.utils import parametrize

# ``distributed`` is reached as ``maskllm.method.distributed`` by tests that spy on the
# sharding of the logits (``shard_modules``)
from lmcompress.compressor import distributed  # noqa: F401
from lmcompress.compressor.method import Stats
from lmcompress.compressor.report import CompressionReport
from lmcompress.errors import ConfigError
from lmcompress.methods.common import count_params, prune_layer_
from lmcompress.methods.maskllm.blockwise import calibrate_blockwise
from lmcompress.methods.maskllm.config import MaskLLMConfig
from lmcompress.methods.maskllm.end_to_end import calibrate_end_to_end
from lmcompress.methods.maskllm.learning import keep_mask
from lmcompress.methods.pruning import PruningMethod

logger = logging.getLogger(__name__)

# per-step entries of the training history that the report keeps
CURVE_KEYS = ("step", "loss", "lm_loss", "rel_err", "tau", "kappa", "flipped")


def _curve(history: list[dict]) -> list[dict]:
    return [{k: h[k] for k in CURVE_KEYS if k in h} for h in history]


class MaskLLM(PruningMethod):
    config_class = MaskLLMConfig

    def _split(self, data: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Training windows and the held-out ones the hard-mask perplexity is measured on."""
        if data is None:
            raise ConfigError("maskllm needs training text (calibration windows)")
        held = min(self.config.training.eval_windows, data.shape[0] - 1)
        return (data[:-held], data[-held:]) if held > 0 else (data, None)

    def calibrate(self, model: nn.Module, data: torch.Tensor | None) -> Stats:
        train_data, eval_data = self._split(data)
        layers = self.validate(model)
        driver = calibrate_blockwise if self.config.blockwise else calibrate_end_to_end
        return driver(self.config, model, train_data, eval_data, layers, self.device)

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
            keep = keep_mask(self.config, name, module, stats.tensors[f"{name}.logits"])
            layer = prune_layer_(name, module, keep, self.config.sparsity_of(name), layer_start)
            if name in errors:  # the error against the dense weights, measured in calibrate
                layer.rel_error, layer.error_kind = errors[name], "output"
            report.layers.append(layer)
        report.seconds = stats.meta.get("seconds", 0.0) + time.perf_counter() - start
        history = stats.meta.get("history", [])
        blocks = stats.meta.get("block_history", [])
        step0 = stats.meta.get("step0")
        report.extra = {
            "loss_curve": _curve(history),
            "hard_ppl": ([{"step": 0, **step0}] if step0 else []) + stats.meta.get("evals", []),
            "steps": len(history) or max((len(b["history"]) for b in blocks), default=0),
        }
        if blocks:
            report.extra["block_curves"] = [
                {"block": b["block"], "curve": _curve(b["history"])} for b in blocks
            ]
        if "trainable_elements_per_process" in stats.meta:
            report.extra["trainable_elements_per_process"] = stats.meta[
                "trainable_elements_per_process"
            ]
        logger.info(
            "maskllm: %d steps, hard-mask ppl %s", report.extra["steps"], report.extra["hard_ppl"]
        )
        return report
