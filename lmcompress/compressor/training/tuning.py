"""Tuning a pruned block's kept weights (``--tune-steps``, beyond the papers): once a block's
masks are learned and its layers extracted (or re-fitted), ``drivers.learn_blockwise`` trains
the block a second time on the same examples and the same block-output error, now the kept
weights under the fixed masks (a ``WeightMask`` parametrization, so a pruned weight stays
exactly 0), then bakes them. The next block learns on the tuned block's outputs.

The optimiser is the same for every method, whatever the mask learning used (SGD at lr 50 on
subnet's logits would be no choice for weights): AdamW, no weight decay, the cosine schedule
without warmup, gradients clipped at norm 1 (MaskLLM's block-wise defaults)."""

from __future__ import annotations

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from lmcompress.compressor.model.surgery import WeightMask, add_parametrization, bake, weight_matrix
from lmcompress.compressor.report import LayerReport
from lmcompress.compressor.training.drivers import Learnable
from lmcompress.compressor.training.trainer import TrainConfig

# TrainConfig fields of the tuning, whatever the mask learning's (steps and lr: the options)
TUNE_OPTIMIZER = {
    "optimizer": "adamw",
    "schedule": "cosine",
    "warmup_steps": 0,
    "weight_decay": 0.0,
    "grad_clip": 1.0,
}


def distill_config(steps: int, lr: float) -> TrainConfig:
    """The distillation of a whole compressed model on the KL from the dense one (low rank's
    factors, structured's kept weights, GPTQ's scales): one calibration window a step, the
    tuning optimiser."""
    return TrainConfig(steps=steps, lr=lr, batch_size=1, **TUNE_OPTIMIZER)


def tune_kept_weights(
    layers: dict[str, nn.Module], keeps: dict[str, torch.Tensor], steps: int, lr: float
) -> Learnable:
    """The weights of ``layers`` to train under their keep-masks ``keeps`` (bool (out, in), one
    per layer), ``steps`` steps at peak ``lr``; ``finish`` bakes them (pruned entries exactly
    0)."""
    for name, module in layers.items():
        keep = keeps[name].to(weight_matrix(module))
        add_parametrization(module, WeightMask(keep.T if isinstance(module, Conv1D) else keep))
    params = {name: m.parametrizations.weight.original for name, m in layers.items()}

    def finish() -> list[LayerReport]:
        for module in layers.values():
            bake(module)
        return []

    return Learnable(
        params=params,
        param_options={name: {"weight_decay": 0.0} for name in layers},
        finish=finish,
        overrides={"steps": steps, "lr": lr, **TUNE_OPTIMIZER},
    )
