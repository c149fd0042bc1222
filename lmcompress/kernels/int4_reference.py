"""Pure-torch definition of the packed low-bit weight layout (the ``int4`` and
``nm_packed_int4`` formats): the specification that compiled kernels are tested against.

A weight ``(out, in)`` is stored as unsigned codes ``q`` in ``[0, 2^bits - 1]`` with, per group
of ``group_size`` consecutive input columns (``-1``: one group per row), a float32 ``scale``
and an integer zero point ``z``; the weight it stands for is ``W = (q - z) · s``:

- ``qweight`` uint8: for ``bits <= 4`` ``(out, ceil(in / 2))``, byte ``j`` of a row holding
  column ``2j`` in its low nibble and column ``2j + 1`` in its high nibble (an odd last column:
  high nibble 0); for ``bits == 8`` ``(out, in)``, one code a byte;
- ``scales`` float32 ``(out, groups)``, ``zeros`` uint8 ``(out, groups)``.

:func:`dequantize` computes ``(q - z) · s`` in float32: ``q - z`` is a small integer, so each
value is one correctly rounded product, the same on every path.
"""

from __future__ import annotations

import torch

from lmcompress.errors import ConfigError
from lmcompress.kernels import reference

BITS = (3, 4, 8)


def check_bits(bits: int) -> None:
    if bits not in BITS:
        raise ConfigError(f"bits must be one of {', '.join(map(str, BITS))}, got {bits!r}")


def packed_columns(bits: int, in_features: int) -> int:
    """Bytes per row of ``qweight``: two codes a byte up to 4 bits, one at 8."""
    return in_features if bits == 8 else -(-in_features // 2)


def pack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes ``q`` (out, in), integers in ``[0, 2^bits - 1]`` -> ``qweight`` uint8 (see the
    module doc). The range is the caller's to keep (the formats check it at load)."""
    check_bits(bits)
    q = q.to(torch.uint8)
    if bits == 8:
        return q.contiguous()
    rows, cols = q.shape
    if cols % 2:  # the odd last column's high nibble is 0
        q = torch.cat([q, q.new_zeros(rows, 1)], dim=1)
    pairs = q.view(rows, -1, 2)  # (out, ceil(in/2), 2): (low, high)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()


def unpack_codes(qweight: torch.Tensor, bits: int, in_features: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: uint8 codes (out, in)."""
    check_bits(bits)
    if bits == 8:
        return qweight
    low, high = qweight & 0x0F, qweight >> 4  # (out, ceil(in/2)) each
    return torch.stack([low, high], dim=-1).flatten(-2)[:, :in_features]


def groups_of(group_size: int, in_features: int) -> int:
    """Groups per row: ``in / group_size``, 1 for ``group_size == -1``."""
    return 1 if group_size == -1 else in_features // group_size


def dequantize_codes(
    q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """``(q - z) · s`` (out, in) float32 from unpacked codes ``q`` (out, in) and per-group
    ``scales`` / ``zeros`` (out, groups)."""
    out_features, in_features = q.shape
    groups = groups_of(group_size, in_features)
    q = q.to(torch.float32).view(out_features, groups, in_features // groups)
    W = (q - zeros.to(torch.float32).unsqueeze(-1)) * scales.to(torch.float32).unsqueeze(-1)
    return W.view(out_features, in_features)


def dequantize(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    bits: int,
    group_size: int,
    in_features: int,
) -> torch.Tensor:
    """The weight ``(q - z) · s`` (out, in), float32, of a packed ``qweight``."""
    return dequantize_codes(unpack_codes(qweight, bits, in_features), scales, zeros, group_size)


# ---- the runtime's computation (the specification of the compiled kernels) ----------------
#
# Decode (a few tokens, :func:`decode_linear`): each token's activations are quantized per
# weight group to int16 (``absmax / 32767``, half to even, floored at ``ACT_MIN_SCALE``), the
# group's products ``D = Σ (q - z) · x_q`` are exact integers, and the float part is fixed:
# ``p_g = (float(D_g) · s_g) · x_scale_g`` summed in :func:`lane_sum`'s fixed order, then
# ``+ bias`` in float32, then the cast to the activations' dtype. Every step is one correctly
# rounded float32 operation on exact inputs, so a kernel that sums its integers in any order
# (and its float terms in that order) equals it bit for bit.
#
# Prefill (many tokens, :func:`prefill_linear`): the weight is dequantized a block of output
# rows at a time into the activations' dtype and multiplied by torch (``F.linear``).

ACT_QMAX = 32767.0
ACT_MIN_SCALE = 1e-12
LANES = 16  # the float partial sums of the decode computation (:func:`lane_sum`)


def group_width(group_size: int, in_features: int) -> int:
    """Columns per group: ``group_size``, or ``in_features`` for ``-1``."""
    return in_features if group_size == -1 else group_size


def nm_codes(
    kept: torch.Tensor,
    indices: torch.Tensor,
    zeros: torch.Tensor,
    n: int,
    m: int,
    group_size: int,
    in_features: int,
) -> torch.Tensor:
    """``q - z`` (out, in) float32 of a packed N:M weight: ``kept`` the kept codes (out, in·n/m)
    uint8 (unpacked), ``indices`` as ``reference.pack_nm``'s; 0 at the pruned columns."""
    per_group = group_width(group_size, in_features) // m * n  # kept values per group
    z_kept = zeros.to(torch.float32).repeat_interleave(per_group, dim=1)
    shifted = kept.to(torch.float32) - z_kept
    return reference.unpack_nm(shifted, indices, n, m, in_features)


def shifted_codes(
    qweight: torch.Tensor,
    zeros: torch.Tensor,
    bits: int,
    group_size: int,
    in_features: int,
    nm: tuple[torch.Tensor, int, int] | None = None,
) -> torch.Tensor:
    """``q - z`` (out, in) float32 (exact small integers): dense ``qweight``, or with ``nm =
    (indices, n, m)`` the packed kept codes (two a byte over the kept axis) and their positions."""
    if nm is None:
        q = unpack_codes(qweight, bits, in_features).to(torch.float32)
        width = group_width(group_size, in_features)
        z = zeros.to(torch.float32).repeat_interleave(width, dim=1)
        return q - z
    indices, n, m = nm
    kept = unpack_codes(qweight, bits, in_features // m * n)
    return nm_codes(kept, indices, zeros, n, m, group_size, in_features)


def dequantize_any(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    bits: int,
    group_size: int,
    in_features: int,
    nm: tuple[torch.Tensor, int, int] | None = None,
) -> torch.Tensor:
    """:func:`dequantize` of a dense or (``nm = (indices, n, m)``) packed N:M weight: (out, in)
    float32, exactly 0 where pruned."""
    d = shifted_codes(qweight, zeros, bits, group_size, in_features, nm)
    width = group_width(group_size, in_features)
    return d * scales.to(torch.float32).repeat_interleave(width, dim=1)


def quantize_activations(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token, per-group int16 codes of ``x`` (T, in), as float32 integers (T, in), and their
    scales (T, groups) float32: ``absmax / 32767`` floored at ``ACT_MIN_SCALE``, then
    ``clamp(round(x / s), -32768, 32767)`` (half to even)."""
    tokens, in_features = x.shape
    width = group_width(group_size, in_features)
    xf = x.to(torch.float32).reshape(tokens, in_features // width, width)
    absmax = torch.maximum(xf.amax(-1), -xf.amin(-1))  # (T, groups)
    scale = (absmax / ACT_QMAX).clamp_min(ACT_MIN_SCALE)
    codes = torch.round(xf / scale.unsqueeze(-1)).clamp_(-32768.0, 32767.0)
    return codes.reshape(tokens, in_features), scale


def decode_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    bits: int,
    group_size: int,
    in_features: int,
    bias: torch.Tensor | None = None,
    nm: tuple[torch.Tensor, int, int] | None = None,
) -> torch.Tensor:
    """The decode computation (module comment above) for ``x`` (T, in) fp32 or bf16: (T, out)
    in ``x``'s dtype. ``nm = (indices, n, m)`` for packed N:M kept codes."""
    tokens = x.shape[0]
    out_features = qweight.shape[0]
    width = group_width(group_size, in_features)
    groups = in_features // width
    x_q, x_scale = quantize_activations(x, group_size)
    d = shifted_codes(qweight, zeros, bits, group_size, in_features, nm)
    # exact: |products| < 2^20, sums far below 2^53 in float64, whatever the order
    D = torch.einsum(
        "tgi,ogi->tog",
        x_q.double().reshape(tokens, groups, width),
        d.double().reshape(out_features, groups, width),
    ).to(torch.float32)  # (T, out, groups): the rounding of an exact integer
    p = (D * scales.to(torch.float32)) * x_scale.unsqueeze(1)  # (T, out, groups)
    y = lane_sum(p)
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype)


def lane_sum(p: torch.Tensor) -> torch.Tensor:
    """The fixed summation order of the groups' float32 terms ``p`` (..., groups): term ``g``
    goes into partial ``g % 16`` (in group order, from +0), then the 16 partials are added in
    a tree (``i + 8``, ``i + 4``, ``i + 2``, ``i + 1``): what 16 vector lanes compute."""
    groups = p.shape[-1]
    pad = -groups % LANES
    p = torch.nn.functional.pad(p, (0, pad)).reshape(*p.shape[:-1], -1, LANES)
    part = torch.zeros(*p.shape[:-2], LANES)
    for k in range(p.shape[-2]):
        part = part + p[..., k, :]
    s8 = part[..., :8] + part[..., 8:]
    s4 = s8[..., :4] + s8[..., 4:]
    return (s4[..., 0] + s4[..., 2]) + (s4[..., 1] + s4[..., 3])


def prefill_linear(
    x: torch.Tensor,
    out_features: int,
    block_rows: int,
    dequantize_rows,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``x`` (T, in) times the weight ``dequantize_rows(start, end)`` gives a block of rows of
    (in ``x``'s dtype), one block of ``block_rows`` output rows at a time (``F.linear`` on each,
    with its part of the bias): (T, out) in ``out_dtype`` (default ``x``'s dtype: each block's
    product rounded once). Each block's product is written into its columns of the output
    (what ``F.linear`` computes: ``addmm`` with the bias, ``mm`` without), not concatenated
    afterwards: at a 49152-word head over 1024 tokens that copy was 100 MB a forward."""
    out_dtype = out_dtype or x.dtype
    if out_features <= block_rows:
        part = None if bias is None else bias.to(x.dtype)
        return torch.nn.functional.linear(x, dequantize_rows(0, out_features), part).to(out_dtype)
    starts = range(0, out_features, block_rows)
    if torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)):
        parts = []  # autograd: out= is not differentiable
        for start in starts:
            end = min(start + block_rows, out_features)
            part = None if bias is None else bias[start:end].to(x.dtype)
            parts.append(torch.nn.functional.linear(x, dequantize_rows(start, end), part))
        return torch.cat(parts, dim=1).to(out_dtype)
    y = torch.empty((x.shape[0], out_features), dtype=out_dtype, device=x.device)
    for start in starts:
        end = min(start + block_rows, out_features)
        W = dequantize_rows(start, end)
        if out_dtype != x.dtype:  # the block's product rounded into its columns
            b = None if bias is None else bias[start:end].to(x.dtype)
            y[:, start:end] = torch.nn.functional.linear(x, W, b)
        elif bias is None:
            torch.mm(x, W.t(), out=y[:, start:end])
        else:
            torch.addmm(bias[start:end].to(x.dtype), x, W.t(), out=y[:, start:end])
    return y
