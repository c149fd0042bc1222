"""Symmetric int8 quantization: the pure tensor math behind the ``int8`` format.

One convention everywhere (the one compressed-tensors and vLLM read):

    q = clamp(round(x / s), qmin, qmax)      x̂ = q · s      zero-point 0

- ``round`` is :func:`torch.round`, which rounds halves to the nearest **even** integer
  (``round(0.5) = 0``, ``round(1.5) = 2``, ``round(-2.5) = -2``), not away from zero. The division
  ``x / s`` is computed first, in float32 (float64 for float64 inputs), then rounded: exactly
  what compressed-tensors' fake quantization does, so its dequantized weights equal ours.
- The int8 range is ``[-128, 127]``. Scales from an absmax divide by 127, so the weights never
  reach -128 (the range is symmetric); a static activation scale may clip, to 127 or -128.
- Scales are float32 and strictly positive. Validating a tensor of scales needs a device sync,
  so the hot path (:func:`quantize`) trusts them: modules check theirs once, at construction,
  with :func:`check_scale`.

Scale shapes: per tensor ``(1,)``, per token ``(tokens, 1)``, per output channel ``(out, 1)``, or
per group of input channels ``(out, in // group_size)``; :func:`quantize` and
:func:`dequantize` accept all of them.
"""

from __future__ import annotations

import torch

from lmcompress.errors import ConfigError

QMIN, QMAX = -128, 127
# Smallest scale a dynamic (per-token) absmax gives: an all-zero row quantizes to 0 instead of
# dividing by 0. Far below any real activation's absmax / 127.
MIN_SCALE = 1e-12


def absmax_scale(
    absmax: torch.Tensor, qmax: float = QMAX, floor: float = MIN_SCALE
) -> torch.Tensor:
    """``absmax / qmax`` in float32, at least ``floor``: the symmetric scale that maps the
    largest magnitude to ``qmax``.

    compressed-tensors' own observers divide by ``(qmax - qmin) / 2 = 127.5``; pass
    ``qmax=127.5`` to reproduce its dynamic activation scales exactly.
    """
    return (absmax.float() / qmax).clamp_min(floor)


def per_token_scale(x: torch.Tensor, qmax: float = QMAX, floor: float = MIN_SCALE) -> torch.Tensor:
    """Dynamic activation scales: ``absmax / qmax`` of each row of ``x`` (..., in) -> (..., 1),
    float32, floored at ``floor`` (an all-zero token gets scale ``floor`` and codes 0)."""
    # max(amax, -amin): two vectorised reductions, ~10x faster on CPU than abs().amax() or
    # vector_norm(inf) (measured, torch 2.13), and exact.
    absmax = torch.maximum(x.amax(-1, keepdim=True), -x.amin(-1, keepdim=True))  # (..., 1)
    return absmax_scale(absmax, qmax, floor)


def weight_scale(absmax: torch.Tensor) -> torch.Tensor:
    """Symmetric weight scales ``absmax / 127``; 1 where ``absmax`` is 0 (codes 0 either way),
    so that no scale is ever 0."""
    return torch.where(absmax > 0, absmax / QMAX, torch.ones_like(absmax))


def on_grid(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``clamp(round(x / s), -127, 127) · s``: ``x`` rounded onto the symmetric int8 grid of
    ``scale`` (broadcasting), in ``x``'s dtype; a new tensor."""
    return torch.div(x, scale).round_().clamp_(-QMAX, QMAX).mul_(scale)


def int8_weight(
    W: torch.Tensor, group_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes of ``W`` (out, in) and their float32 scales.

    Per output channel (``group_size=None``): ``scale`` (out, 1) = row absmax / 127. Per group
    of ``group_size`` consecutive input channels: ``scale`` (out, in // group_size). A row (or
    group) of zeros gets scale 1 and codes 0, so that no scale is ever 0.
    """
    out_features, in_features = W.shape
    W = W.detach().float()
    if group_size is None:
        absmax = W.abs().amax(dim=1, keepdim=True)  # (out, 1)
    else:
        check_group_size(group_size, in_features)
        groups = in_features // group_size
        absmax = W.abs().view(out_features, groups, group_size).amax(dim=-1)  # (out, groups)
    scale = weight_scale(absmax)
    return quantize(W, scale), scale


def quantize(
    x: torch.Tensor, scale: torch.Tensor | float, qmin: int = QMIN, qmax: int = QMAX
) -> torch.Tensor:
    """``clamp(round(x / scale), qmin, qmax)`` as int8 (round half to even, see the module doc).

    ``scale`` broadcasts against ``x`` (..., in), or is ``(out, groups)`` for a grouped weight
    ``x`` (out, in). A Python float scale is checked here; tensors are trusted (check them once
    with :func:`check_scale`).
    """
    if isinstance(scale, (int, float)):
        check_scale(torch.tensor(float(scale)), "quantization scale")
    compute = torch.promote_types(x.dtype, torch.float32)
    x = x.to(compute)
    if isinstance(scale, torch.Tensor) and _is_grouped(scale, x):
        groups = scale.shape[-1]
        x = x.unflatten(-1, (groups, x.shape[-1] // groups))  # (out, groups, group_size)
        scale = scale.unsqueeze(-1)  # (out, groups, 1)
        q = torch.div(x, scale).round_().clamp_(qmin, qmax).flatten(-2)
    else:
        q = torch.div(x, scale).round_().clamp_(qmin, qmax)
    return q.to(torch.int8)


def dequantize(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``q · scale`` in ``dtype``; ``scale`` as for :func:`quantize` (grouped included)."""
    if _is_grouped(scale, q):
        groups = scale.shape[-1]
        values = q.to(dtype).unflatten(-1, (groups, q.shape[-1] // groups))
        return (values * scale.to(dtype).unsqueeze(-1)).flatten(-2)
    return q.to(dtype) * scale.to(dtype)


def simulated_int8_linear(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The W8A8 linear as fake quantization: dequantize both operands, multiply in **float64**,
    add the bias, cast to ``out_dtype``. ``x_q`` (tokens, in), ``x_scale`` (tokens, 1) or (1,),
    ``w_q`` (out, in), ``w_scale`` (out, 1) or (out, groups); returns (tokens, out).

    Why float64: the integer path (``torch.ops.lmcompress.int8_linear``) accumulates in int32,
    exactly; a float32 matmul of dequantized values would round every partial sum, and the two
    paths would differ by that rounding rather than agree. In float64 each dequantized value is
    exact (8-bit code × 24-bit scale) and the sum's error is ~1e-16 relative, so both paths give
    the same float32 result up to the rounding of the final rescale.
    """
    X = dequantize(x_q, x_scale, torch.float64)  # (tokens, in)
    W = dequantize(w_q, w_scale, torch.float64)  # (out, in)
    y = X @ W.t()  # (tokens, out)
    if bias is not None:
        y = y + bias.to(torch.float64)
    return y.to(out_dtype)


def check_scale(scale: torch.Tensor, what: str = "scale") -> None:
    """A one-line :class:`ConfigError` unless every scale is finite and > 0 (one device sync:
    call it when a module is built, never in ``forward``)."""
    if scale.numel() == 0:
        raise ConfigError(f"{what} is empty")
    bad = ~(torch.isfinite(scale) & (scale > 0))
    if bool(bad.any()):
        value = scale.detach().flatten()[bad.flatten()][0].item()
        raise ConfigError(f"{what} must be finite and > 0, got {value:g}")


def check_group_size(group_size: int, in_features: int) -> None:
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size <= 0:
        raise ConfigError(f"group_size must be a positive integer, got {group_size!r}")
    if in_features % group_size:
        raise ConfigError(f"group_size {group_size} does not divide in_features={in_features}")


def _is_grouped(scale: torch.Tensor, x: torch.Tensor) -> bool:
    """True for a per-group weight scale (out, groups > 1) of ``x`` (out, in)."""
    return (
        scale.dim() == 2
        and x.dim() == 2
        and scale.shape[-1] > 1
        and scale.shape[0] == x.shape[0]
        and scale.shape[-1] != x.shape[-1]
    )
