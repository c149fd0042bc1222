"""The 8-bit softmax as a model transform: installed on the compressed model, stored in
``compression.json`` + ``compressed.safetensors``, and installed again by ``load_compressed``.

Its state is the step ``s`` and, per attention module, the folded zero-point ``z' = −β/s``
(``()`` per layer, ``(H,)`` per head; none: uncorrected). It is not part of the
compressed-tensors layout: a model loaded by plain ``transformers`` runs a float softmax.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lmcompress.compressor.formats.base import ModelTransform, register_transform
from lmcompress.compressor.model.attention import close_hook, open_hook
from lmcompress.methods.int8.softmax import SoftmaxQuantizer


@register_transform
class Int8Softmax(ModelTransform):
    kind = "int8_softmax"

    def __init__(self, quantizer: SoftmaxQuantizer, granularity: str = "none") -> None:
        self.quantizer, self.granularity = quantizer, granularity
        self._hook = None

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return self.quantizer.state_tensors()

    def meta(self) -> dict[str, Any]:
        return {"scale": self.quantizer.scale, "bias_correction": self.granularity}

    @classmethod
    def from_state(cls, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> Int8Softmax:
        quantizer = SoftmaxQuantizer(float(meta["scale"]), dict(tensors))
        return cls(quantizer, meta.get("bias_correction", "none"))

    def _install(self, model: nn.Module) -> None:
        self._hook = open_hook(model, transform=self.quantizer)
        self.quantizer.names = self._hook.name

    def _remove(self, model: nn.Module) -> None:
        close_hook(model, self._hook)
        self.quantizer.names, self._hook = None, None
