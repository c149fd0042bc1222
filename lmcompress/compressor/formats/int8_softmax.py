"""``int8_softmax``: 8-bit attention probabilities with their bias correction folded in, as a
model transform (installed on a compressed model, stored in ``compression.json`` +
``compressed.safetensors``, installed again on load).

Pandey et al., "Softmax Bias Correction for Quantized Generative Models" (arXiv 2309.01729).
The paper publishes no code and its exact formula was not available: what follows is our
reconstruction, written out so a reader can check it.

Quantization of one probability (unsigned 8 bits, round half to even as ``torch.round``)::

    q = clamp(round(p / s), 0, 255),    Q(p) = s · q,    s = 1/255 (or 1/256: p = 1 clamps to 255)

Rounding is unbiased for values spread over many steps, but most attention probabilities lie far
below one step: they round to 0, each quantized row sums to less than one, and the error
``p − Q(p)`` has a positive mean β rather than being zero-mean noise. The correction estimates

    β = E_calib[p − Q(p)]   over the valid entries (per layer: the paper; per head: ours)

and adds it on dequantization, ``p̂ = s·q + β``, which is a shifted zero-point::

    p̂ = s · (q − z'),    z' = −β / s        (valid entries; masked entries stay 0)

so deployment changes a quantization parameter and adds no compute: an integer ``P·V`` with an
asymmetric P subtracts ``z'·Σ_valid V`` exactly as it would for any zero-point.

Which entries are valid. Adding β to every entry would give masked (future) keys a weight and
make the model non-causal. The attention function hands us probabilities, not the mask, so the
rule is ``valid = p > 0`` in the softmax's output: masked keys are exactly 0 (their score is
the dtype's minimum, ``exp`` underflows), so they never get β. An unmasked key is 0 only when its
score is ~104 below the row's maximum (fp32; ~17 in fp16): it stays 0 too, in calibration and in
deployment alike, so β is the exact mean error of the entries it is added to. The tempting
``q > 0`` would skip precisely the entries that carry the bias (those rounded to 0). An integer
kernel that knows the mask agrees with this rule except on such underflowed keys.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lmcompress.compressor.formats.base import ModelTransform, check_finite
from lmcompress.compressor.formats.registry import register_transform
from lmcompress.compressor.model.attention import (
    AttentionHook,
    attention_hook,
    close_hook,
    open_hook,
)
from lmcompress.errors import ConfigError, ModelLoadError, shown
from lmcompress.kernels.int8_softmax import int8_softmax

QMAX = 255  # unsigned 8 bits
DEFAULT_SCALE = 1 / 255


def check_scale(scale: float) -> float:
    """``scale`` as a float, or a one-line :class:`ConfigError` if it is not in (0, 1]."""
    scale = float(scale)
    if not 0.0 < scale <= 1.0:  # also rejects NaN
        raise ConfigError(f"softmax scale must lie in (0, 1] (e.g. 1/255 or 1/256), got {scale}")
    return scale


def quantize_probs_int(p: torch.Tensor, scale: float = DEFAULT_SCALE) -> torch.Tensor:
    """``q = clamp(round(p / s), 0, 255)`` as uint8, same shape as ``p``."""
    scale = check_scale(scale)
    return torch.round(p.float() / scale).clamp_(0, QMAX).to(torch.uint8)


def dequantize_probs(
    q: torch.Tensor,  # uint8, (B, H, Tq, Tk)
    scale: float,
    zero_point: torch.Tensor | float | None,  # broadcastable to q: () or (H, 1, 1)
    valid: torch.Tensor,  # bool, like q
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``s · (q − z')`` on valid entries, 0 elsewhere (the folded form of the correction)."""
    if zero_point is None:  # masked entries already have q = 0
        return q.to(dtype) * scale
    zero_point = torch.as_tensor(zero_point, dtype=torch.float32, device=q.device)
    p_hat = (scale * (q.float() - zero_point)).to(dtype)
    return p_hat.masked_fill(~valid, 0.0)


def quantize_probs(
    p: torch.Tensor,
    scale: float = DEFAULT_SCALE,
    offset: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """``p̂ = s · clamp(round(p / s), 0, 255)`` (+ ``offset`` where ``p > 0``), in ``p``'s dtype.

    ``offset`` is β, the explicit correction: a float, or a tensor broadcastable to ``p``
    ((H, 1, 1) for per-head offsets of (B, H, Tq, Tk) probabilities). It is added only to the
    valid entries, ``p > 0`` (see the module docstring: masked keys stay 0, so causality holds).
    """
    p_hat = quantize_probs_int(p, scale).to(p.dtype) * scale
    if offset is not None:
        offset = torch.as_tensor(offset, dtype=p.dtype, device=p.device)
        p_hat = torch.where(p > 0, p_hat + offset, p_hat)
    return p_hat


def fold_bias(bias: torch.Tensor, scale: float) -> torch.Tensor:
    """The zero-point that applies the correction: ``z' = −β / s`` (float32, β's shape)."""
    return (-bias.double() / check_scale(scale)).float()


def _per_head(value: torch.Tensor) -> torch.Tensor:
    """() stays (); (H,) becomes (H, 1, 1) to broadcast against (B, H, Tq, Tk)."""
    return value if value.dim() == 0 else value.reshape(-1, 1, 1)


@dataclass
class SoftmaxQuantizer:
    """The 8-bit softmax as an ``attention_hook`` transform, with its folded correction.

    ``zero_point`` maps an attention module's qualified name to ``z'`` (float32, () per layer or
    (H,) per head); a module without an entry is quantized uncorrected (z' = 0). Use it with
    :meth:`applied` (which binds module names), or set ``names`` (e.g. ``hook.name``) and pass the
    instance as ``transform=``.
    """

    scale: float = DEFAULT_SCALE
    zero_point: dict[str, torch.Tensor] = field(default_factory=dict)
    names: object = None  # Callable[[nn.Module], str | None], set by ``applied``

    def __post_init__(self) -> None:
        self.scale = check_scale(self.scale)
        self.zero_point = {k: torch.as_tensor(v).float() for k, v in self.zero_point.items()}

    @classmethod
    def from_bias(
        cls, bias: Mapping[str, torch.Tensor], scale: float = DEFAULT_SCALE
    ) -> SoftmaxQuantizer:
        """Fold per-layer or per-head β (:func:`estimate_bias`) into zero-points."""
        return cls(scale, {name: fold_bias(b, scale) for name, b in bias.items()})

    def quantize(self, name: str | None, probs: torch.Tensor) -> torch.Tensor:
        """Quantize (B, H, Tq, Tk) probabilities of module ``name``, dequantized in their dtype."""
        q = quantize_probs_int(probs, self.scale)
        zero_point = self.zero_point.get(name) if name is not None else None
        if zero_point is not None:
            zero_point = _per_head(zero_point.to(probs.device))
        return dequantize_probs(q, self.scale, zero_point, probs > 0, probs.dtype)

    def softmax(
        self, module: nn.Module, scores: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """The 8-bit softmax as it deploys: ``torch.ops.lmcompress.int8_softmax`` (the reference
        on CPU, the Triton kernel on CUDA) from the scores (B, H, Tq, Tk) and the additive mask,
        the correction passed as the op's offset ``β = −s·z'`` per layer or head. Returns the
        dequantized probabilities, float32. It equals :meth:`quantize` of the float softmax up
        to one step where a probability lies on a rounding boundary (the op's exp is its own)
        and, for keys whose probability underflows to 0 unmasked, the offset (the op adds it to
        every allowed key)."""
        name = self.names(module) if self.names is not None else None
        zero_point = self.zero_point.get(name) if name is not None else None
        offset = None if zero_point is None else (-zero_point * self.scale).to(scores.device)
        _, out = int8_softmax(scores, mask, offset, self.scale)
        return out

    def __call__(self, module: nn.Module, probs: torch.Tensor) -> torch.Tensor:
        name = self.names(module) if self.names is not None else None
        return self.quantize(name, probs)

    @contextlib.contextmanager
    def applied(self, model: nn.Module) -> Iterator[AttentionHook]:
        """Run ``model`` with this 8-bit softmax inside the ``with`` block."""
        with attention_hook(model) as hook:
            self.names = hook.name
            hook.transform = self
            try:
                yield hook
            finally:
                self.names = None

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """``{module name: z'}`` for safetensors; the scale goes in the manifest (``meta``)."""
        return {name: z.contiguous() for name, z in self.zero_point.items()}

    def meta(self) -> dict[str, float]:
        return {"scale": self.scale}

    @classmethod
    def from_state(
        cls, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, float]
    ) -> SoftmaxQuantizer:
        """The inverse of :meth:`state_tensors` and :meth:`meta`."""
        return cls(float(meta["scale"]), dict(tensors))


@register_transform
class Int8Softmax(ModelTransform):
    """The 8-bit softmax on a whole model. Its state is the step ``s`` and, per attention
    module, the folded zero-point ``z' = −β/s`` (``()`` per layer, ``(H,)`` per head; none:
    uncorrected). It is not part of the compressed-tensors layout: a model loaded by plain
    ``transformers`` runs a float softmax."""

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
        """Rebuild from :meth:`state_tensors` and :meth:`meta`, checked: a scale in (0, 1], a
        float32 zero-point per module, () or (H,), finite (else a :class:`ModelLoadError`)."""
        scale = meta.get("scale") if isinstance(meta, dict) else None
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale <= 1:
            raise ModelLoadError(f"int8_softmax: meta field scale is {shown(scale)}, not in (0, 1]")
        for key, zero_point in tensors.items():
            if zero_point.dtype != torch.float32 or zero_point.dim() > 1:
                raise ModelLoadError(
                    f"int8_softmax zero-point {key} is {zero_point.dtype} "
                    f"{list(zero_point.shape)}, expected float32 () or (heads,)"
                )
        check_finite("int8_softmax", tensors)
        quantizer = SoftmaxQuantizer(float(scale), dict(tensors))
        return cls(quantizer, meta.get("bias_correction", "none"))

    def _install(self, model: nn.Module) -> None:
        self._hook = open_hook(model, softmax=self.quantizer.softmax)
        self.quantizer.names = self._hook.name

    def _remove(self, model: nn.Module) -> None:
        close_hook(model, self._hook)
        self.quantizer.names, self._hook = None, None
