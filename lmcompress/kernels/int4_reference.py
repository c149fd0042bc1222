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
