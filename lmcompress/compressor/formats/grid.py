"""The uniform low-bit grid of the ``int4`` formats (3, 4 or 8 bits): pure tensor math shared by
round-to-nearest (``Int4Linear.from_linear``) and GPTQ's solver.

GPTQ's reference quantizer (``IST-DASLab/gptq``, ``quant.Quantizer``), per row of a group of
columns ``x`` (rows, k), with ``maxq = 2^bits - 1``:

    xmin = min(min x, 0),  xmax = max(max x, 0)           (the grid always holds 0)
    symmetric:  xmax = max(|xmin|, xmax), xmin = -xmax,   z = 2^(bits-1)
    asymmetric:                                            z = round(-xmin / s)
    s = (xmax - xmin) / maxq        (a row of zeros: xmin = -1, xmax = 1)
    q = clamp(round(x / s) + z, 0, maxq),    x̂ = (q - z) · s

One deviation: the reference sets ``xmin = -xmax`` only when ``xmin < 0``, so a symmetric row
with no negative weight gets half the step and its top codes clip at ``7 s`` (4 bits); here a
symmetric grid is always ``[-absmax, absmax]``. Scales are float32 (what is stored), rounding
is :func:`torch.round` (half to even).

``mse``: the reference quantizer's clipping search (``Quantizer.configure(mse=True)``, its
defaults ``norm=2.4, grid=100, maxshrink=0.8``): the range shrunk to ``p · [xmin, xmax]`` for
``p = 1, 0.99, ..., 0.21``, each row keeping the first ``p`` with the least ``Σ |x̂ − x|^2.4``
(a weight error, not GPTQ's output error); outliers are then clipped to give the other weights
a finer step. llm-compressor's ``mse`` observer searches the start of the same grid (``p`` down
to 0.8 by default, stopping after 5 steps without a better one).
"""

from __future__ import annotations

import torch

from lmcompress.errors import LmcompressError


def max_code(bits: int) -> int:
    return (1 << bits) - 1


def half_scales(scale: torch.Tensor) -> torch.Tensor:
    """``scale`` (float32, > 0) rounded to the nearest float16 number, kept float32: what GGUF's
    ``Q4_0`` / ``Q8_0`` blocks store, so that a grid fitted with it exports exactly. A scale
    below float16's smallest subnormal becomes that subnormal (never 0); one above its range
    is an error."""
    rounded = scale.to(torch.float16).to(torch.float32)
    if not torch.isfinite(rounded).all():
        raise LmcompressError(
            f"a weight group's scale {float(scale.max()):.3g} is beyond float16's range: "
            "use --scale-dtype float32"
        )
    return rounded.clamp_min_(2.0**-24)


MSE_NORM, MSE_GRID, MSE_MAXSHRINK = 2.4, 100, 0.8  # the reference quantizer's defaults


def grid_params(
    x: torch.Tensor, bits: int, symmetric: bool, half: bool = False, mse: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, zero)`` (rows,) of each row of ``x`` (rows, k): float32 scales > 0 and
    integer-valued float32 zero points in ``[0, maxq]`` (see the module doc); ``half``: each
    scale a float16 number (:func:`half_scales`), the zero point fitted to it; ``mse``: the
    range each row clips to chosen by the reference's search (module doc)."""
    x = x.detach().to(torch.float32)
    zero_col = torch.zeros(x.shape[0], dtype=x.dtype, device=x.device)
    xmin = torch.minimum(x.amin(dim=1), zero_col)
    xmax = torch.maximum(x.amax(dim=1), zero_col)
    if symmetric:
        xmax = torch.maximum(-xmin, xmax)
        xmin = -xmax
    empty = (xmin == 0) & (xmax == 0)
    xmin, xmax = xmin.masked_fill(empty, -1.0), xmax.masked_fill(empty, 1.0)
    scale, zero = _range_params(xmin, xmax, bits, symmetric, half)
    if not mse:
        return scale, zero
    best = torch.full_like(scale, float("inf"))
    for i in range(int(MSE_MAXSHRINK * MSE_GRID)):
        p = 1 - i / MSE_GRID
        scale1, zero1 = _range_params(p * xmin, p * xmax, bits, symmetric, half)
        err = norm_error(on_grid(x, scale1[:, None], zero1[:, None], bits).sub_(x)).sum(dim=1)
        better = err < best  # strictly: ties keep the wider range, as the reference
        best = torch.where(better, err, best)
        scale, zero = torch.where(better, scale1, scale), torch.where(better, zero1, zero)
    return scale, zero


def norm_error(e: torch.Tensor) -> torch.Tensor:
    """``|e|^2.4`` (``MSE_NORM``), in place, as ``e² · exp(0.4 · ln|e|)``: torch's float32
    ``pow`` with a non-integer exponent was most of the clipping search's time, several times
    this form's, and no more accurate (``tests/compressor/formats/test_grid_norm.py`` holds
    this one to 1e-6 of float64). An exact 0 stays 0 (``ln 0 = -inf``)."""
    squared = e.square()
    return e.abs_().log_().mul_(MSE_NORM - 2).exp_().mul_(squared)


def _range_params(
    xmin: torch.Tensor, xmax: torch.Tensor, bits: int, symmetric: bool, half: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, zero)`` of the grid spanning ``[xmin, xmax]`` (``xmin < 0 < xmax``)."""
    scale = (xmax - xmin) / max_code(bits)
    if half:
        scale = half_scales(scale)
    if symmetric:
        zero = torch.full_like(scale, float(1 << (bits - 1)))
    else:
        zero = torch.round(-xmin / scale).clamp_(0, max_code(bits))
    return scale, zero


def codes(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """``clamp(round(x / s) + z, 0, maxq)`` in ``x``'s (floating) dtype; ``scale`` and
    ``zero`` broadcast against ``x``."""
    scale, zero = scale.to(x.dtype), zero.to(x.dtype)
    return torch.div(x, scale).round_().add_(zero).clamp_(0, max_code(bits))


def on_grid(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """``x`` rounded onto the grid: ``(q - z) · s`` in ``x``'s dtype (a new tensor)."""
    return codes(x, scale, zero, bits).sub_(zero.to(x.dtype)).mul_(scale.to(x.dtype))


def group_params(
    W: torch.Tensor,
    bits: int,
    group_size: int,
    symmetric: bool,
    half: bool = False,
    mse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scales, zeros)`` (out, groups) of ``W`` (out, in) per group of ``group_size``
    consecutive columns (``-1``: the whole row), from the weights as they are (``half``,
    ``mse``: as :func:`grid_params`)."""
    out_features, in_features = W.shape
    size = in_features if group_size == -1 else group_size
    flat = W.detach().reshape(out_features * (in_features // size), size)
    scale, zero = grid_params(flat, bits, symmetric, half, mse)
    return scale.view(out_features, -1), zero.view(out_features, -1)


def expand(per_group: torch.Tensor, in_features: int) -> torch.Tensor:
    """(out, groups) -> (out, in): each group's value repeated over its columns."""
    return per_group.repeat_interleave(in_features // per_group.shape[1], dim=1)


def quantize_groups(
    W: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int
) -> torch.Tensor:
    """Round-to-nearest uint8 codes (out, in) of ``W`` on the grid ``scales``/``zeros``
    (out, groups)."""
    in_features = W.shape[1]
    q = codes(
        W.detach().to(torch.float32), expand(scales, in_features), expand(zeros, in_features), bits
    )
    return q.to(torch.uint8)
