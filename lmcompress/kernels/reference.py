"""Pure-torch definitions of the compressed formats and ops: the specification that Triton
kernels are tested against.

Packed N:M layout of an ``(out, in)`` weight whose every group of ``m`` consecutive input
weights holds at most ``n`` nonzeros:

- ``values``: ``(out, in * n / m)``, the kept weights of each group in increasing position order
  (groups with fewer than ``n`` nonzeros keep explicit zeros);
- ``indices``: ``(out, ceil(in * n / m / per_byte))`` uint8, each kept weight's position inside its
  group (``0 .. m-1``) in ``index_bits(m)`` bits, ``per_byte = 8 / index_bits`` positions a byte,
  least-significant bits first. For 2:4 that is 2 bits a position, 4 bits a group: with fp16
  values (2·16 + 4) / 64 = 56.25 % of the dense bytes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from lmcompress.errors import ConfigError


def index_bits(m: int) -> int:
    """Bits stored per position: ``ceil(log2 m)`` rounded up to 1, 2, 4 or 8 (whole bytes)."""
    if not 2 <= m <= 256:
        raise ConfigError(f"packed N:M supports 2 <= M <= 256, got M={m}")
    need = max(1, math.ceil(math.log2(m)))
    return next(b for b in (1, 2, 4, 8) if b >= need)


def packed_nm_nbytes(shape: tuple[int, int], n: int, m: int, dtype: torch.dtype) -> int:
    """Bytes of the packed form of an ``(out, in)`` weight (values plus positions)."""
    out_features, in_features = shape
    kept = in_features // m * n
    per_byte = 8 // index_bits(m)
    elem = torch.empty((), dtype=dtype).element_size()
    return out_features * (kept * elem + math.ceil(kept / per_byte))


def pack_nm(weight: torch.Tensor, n: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack an N:M-sparse ``(out, in)`` weight into ``(values, indices)`` (see module doc)."""
    out_features, in_features = weight.shape
    if in_features % m:
        raise ConfigError(f"in_features={in_features} is not divisible by M={m}")
    groups = weight.reshape(out_features, in_features // m, m)  # (out, G, m)
    nonzero = groups != 0
    if nonzero.numel() and int(nonzero.sum(-1).max()) > n:
        raise ConfigError(f"weight is not {n}:{m} sparse: a group has more than {n} nonzeros")
    # Positions of the nonzeros first (ties broken by position), then sorted ascending.
    rank = nonzero.to(torch.int16) * m - torch.arange(m, device=weight.device, dtype=torch.int16)
    positions = rank.topk(n, dim=-1).indices.sort(dim=-1).values  # (out, G, n)
    values = groups.gather(-1, positions).reshape(out_features, -1)  # (out, G * n)
    return values.contiguous(), _pack_bits(positions.reshape(out_features, -1), index_bits(m))


def unpack_nm(
    values: torch.Tensor, indices: torch.Tensor, n: int, m: int, in_features: int
) -> torch.Tensor:
    """Inverse of :func:`pack_nm`: the dense ``(out, in)`` weight."""
    out_features = values.shape[0]
    groups = in_features // m
    positions = _unpack_bits(indices, index_bits(m), groups * n).to(torch.int64)
    dense = torch.zeros(out_features, groups, m, dtype=values.dtype, device=values.device)
    dense.scatter_(
        -1, positions.reshape(out_features, groups, n), values.reshape(out_features, groups, n)
    )
    return dense.reshape(out_features, in_features)


def bad_positions(
    indices: torch.Tensor,
    n: int,
    m: int,
    kept: int,
    first_bad_byte: Callable[[torch.Tensor, int, torch.Tensor], tuple[int, int] | None]
    | None = None,
) -> str | None:
    """Why ``indices`` is not a layout :func:`pack_nm` writes, or ``None``: every position is
    below ``m`` and the ``n`` positions of each group strictly ascend (so they are distinct).
    A file whose codes break this would make the unpacked weight silently wrong (a repeated
    position drops a value) or index outside its group.

    Where each byte holds whole groups (2:4: two), each byte is looked up in the table of the
    256 byte values (:func:`valid_bytes`): by ``first_bad_byte(indices, bytes, table)`` where
    given (the compiled CPU kernel), else in torch; other layouts unpack their codes. The
    padding codes after the last group are not checked."""
    bits = index_bits(m)
    per_byte = 8 // bits
    full_bytes = kept // per_byte if per_byte % n == 0 else 0
    if full_bytes:
        table = valid_bytes(n, m).to(indices.device)  # a packed layer loaded onto a GPU
        if first_bad_byte is not None:
            bad = first_bad_byte(indices, full_bytes, table)
        else:
            ok = table[indices[:, :full_bytes].to(torch.int64)]
            bad = None if bool(ok.all()) else tuple((~ok).nonzero()[0].tolist())
        if bad is not None:
            row, byte = bad
            found = _unpack_bits(indices[row : row + 1, byte : byte + 1], bits, per_byte)
            return f"row {row}, byte {byte}: positions {found.tolist()[0]}, {_RULE.format(n, m)}"
    done = full_bytes * per_byte
    if done < kept:
        groups = _unpack_bits(indices, bits, kept)[:, done:]
        groups = groups.reshape(groups.shape[0], -1, n)
        ok = _valid_groups(groups, m)
        if not bool(ok.all()):
            row, group = (~ok).nonzero()[0].tolist()
            return f"row {row}: positions {groups[row, group].tolist()}, {_RULE.format(n, m)}"
    return None


@functools.cache
def valid_bytes(n: int, m: int) -> torch.Tensor:
    """(256,) bool: which index bytes hold whole groups of ``n`` ascending positions below
    ``m`` (for layouts whose bytes hold whole groups)."""
    bits = index_bits(m)
    per_byte = 8 // bits
    codes = _unpack_bits(torch.arange(256, dtype=torch.uint8).unsqueeze(1), bits, per_byte)
    return _valid_groups(codes.reshape(256, per_byte // n, n), m).all(-1)


def _valid_groups(groups: torch.Tensor, m: int) -> torch.Tensor:
    """(..., n) codes -> (...) bool: all below ``m`` and strictly ascending."""
    return (groups < m).all(-1) & (groups[..., 1:] > groups[..., :-1]).all(-1)


_RULE = "not {} ascending positions below {} per group"


def gather_nm(dense: torch.Tensor, indices: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """The entries of a dense ``(out, in)`` matrix at the packed positions: ``(out, in * n / m)``.

    The adjoint of :func:`unpack_nm` in its values: the gradient of the packed ``values`` is
    ``gather_nm(dW, indices, n, m)`` of the dense weight gradient ``dW``.
    """
    out_features, in_features = dense.shape
    groups = in_features // m
    positions = _unpack_bits(indices, index_bits(m), groups * n).to(torch.int64)
    gathered = dense.reshape(out_features, groups, m).gather(
        -1, positions.reshape(out_features, groups, n)
    )  # (out, G, n)
    return gathered.reshape(out_features, groups * n)


def _pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """(rows, k) small integers -> (rows, ceil(k / (8 / bits))) uint8, low bits first."""
    per_byte = 8 // bits
    rows, k = codes.shape
    padded = torch.zeros(
        rows, math.ceil(k / per_byte) * per_byte, dtype=torch.int32, device=codes.device
    )
    padded[:, :k] = codes
    shifts = torch.arange(per_byte, device=codes.device, dtype=torch.int32) * bits
    packed = (padded.reshape(rows, -1, per_byte) << shifts).sum(-1)
    return packed.to(torch.uint8)


def _unpack_bits(packed: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    per_byte = 8 // bits
    shifts = torch.arange(per_byte, device=packed.device, dtype=torch.int32) * bits
    codes = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(packed.shape[0], -1)[:, :k]


def nm_linear(
    x: torch.Tensor,
    values: torch.Tensor,
    indices: torch.Tensor,
    n: int,
    m: int,
    in_features: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W.T + bias`` with ``W`` given in packed N:M form (reference: unpack, then matmul)."""
    weight = unpack_nm(values, indices, n, m, in_features)
    return torch.nn.functional.linear(x, weight.to(x.dtype), bias)
