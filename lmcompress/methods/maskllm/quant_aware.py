"""Masks learned for an int8 stage that follows (``--quant-aware int8``, beyond the paper): while
a layer's mask learns, its masked weight and its input are fake-quantized the way the ``int8``
method will quantize them (W8A8: symmetric int8 codes per output channel, :func:`~lmcompress.
compressor.formats.quant.int8_weight`'s convention, and per token, dynamic), with
straight-through rounding: forward ``x̂ = q·s``, backward the identity. The mask then learns
which weights to keep *given* the rounding both operands will get; the re-fit that follows
(``sparsegpt.refit.refit_layer(..., quantize=True)``) quantizes column by column and pushes
each column's rounding error onto the columns not yet quantized (GPTQ's update, inside
SparseGPT's OBS pass, as the SparseGPT paper's joint sparsification and quantization does).

Both fake quantizers follow their mask's ``enabled``: off, the layer is the dense teacher
(``--distill``), unquantized too."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lmcompress.compressor.formats.quant import on_grid, per_token_scale, weight_scale
from lmcompress.compressor.model.surgery import add_parametrization
from lmcompress.methods.maskllm.parametrization import LearnableNMMask

QUANT_AWARE = ("none", "int8")


def fake_quant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``clamp(round(x / s), -127, 127) · s`` forward, the identity backward (straight-through);
    ``scale`` broadcasts against ``x`` and is not differentiated."""
    return x + (on_grid(x.detach(), scale.detach()) - x.detach())


def channel_scale(weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    """Per output channel ``absmax / 127`` of ``weight`` (out, in), or (in, out) if
    ``transposed``; a channel of zeros gets scale 1 (its codes are 0 either way)."""
    absmax = weight.detach().abs().amax(dim=0 if transposed else 1, keepdim=True)
    return weight_scale(absmax).float()


class FakeQuantWeight(nn.Module):
    """A parametrization after the mask's: the masked weight, fake-quantized per output
    channel (its scale from the masked weight itself, as ``int8`` computes it)."""

    def __init__(self, mask: LearnableNMMask) -> None:
        super().__init__()
        self.transposed = mask.transposed
        self._mask = [mask]  # a plain list: not a submodule (the mask is the first parametrization)

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        if not self._mask[0].enabled:
            return weight
        return fake_quant(weight, channel_scale(weight, self.transposed).to(weight.dtype))


def attach(module: nn.Module, mask: LearnableNMMask) -> RemovableHandle:
    """Fake-quantize ``module``'s masked weight (a second parametrization, removed with the
    mask's) and its input (a forward pre-hook: remove it with the handle returned)."""
    add_parametrization(module, FakeQuantWeight(mask))

    def quantize_input(_module: nn.Module, args: tuple) -> tuple | None:
        if not mask.enabled or not args:
            return None
        x = args[0]
        return (fake_quant(x, per_token_scale(x.detach()).to(x.dtype)), *args[1:])

    return module.register_forward_pre_hook(quantize_input)
