"""``gptq --distill-steps``: after GPTQ, every group's scale trained end to end, the integer
codes and zero points fixed: the E2E-QP stage of EfficientQAT (Chen et al. 2024, arXiv
2407.11062, its second stage: "only the quantization step sizes are trained"), here on the KL
divergence from the dense model's logits over the calibration windows (the toolkit's
distillation path, ``drivers.learn_end_to_end`` with ``distill``), not on the LM loss of those
few windows.

The format does not change: the same codes, zero points and layout, only other float32 scales,
so every export (compressed-tensors pack-quantized, GGUF) and kernel reads the result as it
reads GPTQ's. A pruned weight's code is its zero point, so it stays exactly 0.

Each quantized layer's dense module (the one GPTQ replaced) comes back for the training with a
:class:`ScaleWeight` parametrization, ``W -> (q - z) · s``, whose ``enabled`` off gives the
stored dense weight: the teacher is the same model with the parametrizations off, no second
copy of it. Afterwards the trained scales go into the quantized layers, which replace the
dense modules again.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from lmcompress.compressor.formats.int4 import Int4CodedLinear
from lmcompress.compressor.model.surgery import add_parametrization, replace_module
from lmcompress.compressor.training.drivers import Learnable, learn_end_to_end
from lmcompress.compressor.training.tuning import distill_config


class ScaleWeight(nn.Module):
    """Parametrization ``W -> (q - z) · s`` of a dense module's weight from a quantized layer:
    ``q - z`` fixed (bfloat16, exact for codes of up to 8 bits), ``s`` a trainable float32
    (out, groups); ``transposed``: the stored weight is (in, out) (GPT-2's Conv1D). With
    ``enabled`` off, the stored (dense) weight."""

    def __init__(self, layer: Int4CodedLinear, transposed: bool) -> None:
        super().__init__()
        codes = layer.weight_codes().to(torch.int16)  # (out, in)
        width = codes.shape[1] // layer.scales.shape[1]
        zeros = layer.zeros.to(torch.int16).repeat_interleave(width, dim=1)  # (out, in)
        self.register_buffer("shifted", (codes - zeros).to(torch.bfloat16))
        self.scales = nn.Parameter(layer.scales.detach().to(torch.float32).clone())
        self.transposed = transposed
        self.enabled = True

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return weight
        rows, columns = self.shifted.shape
        groups = self.scales.shape[1]
        W = self.shifted.float().view(rows, groups, columns // groups) * self.scales[..., None]
        W = W.view(rows, columns)
        return (W.T if self.transposed else W).to(weight.dtype)


def distill_scales(
    model: nn.Module,
    data: torch.Tensor,
    dense: dict[str, nn.Module],
    steps: int,
    lr: float,
    half_scales: bool = False,
) -> list[dict]:
    """Train the scales of ``model``'s quantized layers named in ``dense`` (name -> the dense
    module each replaced, its weight unchanged) for ``steps`` steps, one window of ``data``
    (N, L) each, AdamW at peak ``lr`` with the cosine schedule, on KL(dense ‖ quantized); the
    quantized layers, their scales replaced (rounded to float16 with ``half_scales``), are in
    ``model`` again afterwards. Returns the loss curve."""
    quantized = {name: model.get_submodule(name) for name in dense}
    weights = {}
    for name, module in dense.items():
        weights[name] = ScaleWeight(quantized[name], isinstance(module, Conv1D))
        add_parametrization(module, weights[name])
        replace_module(model, name, module)
    learnable = Learnable(
        params={f"{name}.scales": w.scales for name, w in weights.items()},
        param_options={f"{name}.scales": {"weight_decay": 0.0} for name in weights},
        masks=list(weights.values()),
        fixed_teacher=True,  # the teacher is the dense weights, none of them trained
    )
    config = distill_config(steps, lr)
    try:
        with torch.enable_grad():  # also under a caller's no_grad
            result = learn_end_to_end(model, data, learnable, config, distill=True, lm_loss=False)
    finally:  # the quantized layers back in place, trained or not
        for name, layer in quantized.items():
            replace_module(model, name, layer)
    with torch.no_grad():
        for name, layer in quantized.items():
            scales = weights[name].scales.detach().clamp_min(torch.finfo(torch.float16).tiny)
            layer.scales = scales.half().float() if half_scales else scales.clone()
    return result.state.history
