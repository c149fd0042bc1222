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

The 8-bit softmax ``lmcompress::int8_softmax`` (:func:`int8_softmax_reference`; the op is in
:mod:`lmcompress.kernels.int8_softmax`, its constants in
:mod:`lmcompress.kernels.softmax_constants`). For scores ``(B, H, Tq, Tk)`` (2-D and 3-D scores
read as ``(1, 1, ·, ·)`` and ``(1, H, ·, ·)``), an additive ``mask`` broadcastable to them, a
per-row-group ``offset`` broadcastable to ``(B, H)`` (per layer: one value; per head: ``(H,)``)
and a ``scale``:

- ``x = float32(scores) + float32(mask)`` (inputs in bf16/fp16 are upcast first);
- ``p = exp(x - max x) / sum exp(x - max x)`` along ``Tk``; a row whose ``x`` are all ``-inf``
  has ``p = 0`` (not NaN);
- ``q = clamp(round(p / scale), 0, 255)`` as uint8, rounding half to even (``torch.round``);
- ``out = q * scale + offset[b, h]`` where the key is *allowed*, ``q * scale`` elsewhere, as
  float32. Allowed: ``x > -inf`` and ``mask > MASKED_AT`` (-1e4, which every masking convention
  in use lies below: ``-inf``, each dtype's ``finfo.min``, ``-1e4``, ``-1e9``). Adding the offset
  to masked (future) keys would let them leak into the output, so they keep ``q * scale = 0``.
  Fully masked rows (a padding query under a ``finfo.min`` mask) stay what eager attention
  makes of them, a uniform row, with no offset.

The exact arithmetic is part of the definition, so that the Triton kernel equals this reference
bit for bit rather than up to a rounding of ``p / scale`` that lands on the other side of a half:

- ``exp`` is :func:`exp_reference` (``2**n`` times a degree-6 polynomial in ``f = t - floor t``,
  ``t = x log2 e``; max relative error ~1e-7 near 0, growing as ``|x| 2**-24``), not the
  platform's ``exp`` (``torch.exp`` and numpy's ``exp`` differ in the last bit on ~40 % of float32
  inputs, and so does CUDA's);
- the max and the sum are online (Milakov & Gimelshein, arXiv 1805.02867) over blocks of
  ``BLOCK = 64`` columns: ``m_j = max(m_{j-1}, max block_j)``,
  ``s_j = s_{j-1} exp(m_{j-1} - m_j) + pairwise_sum(exp(block_j - m_j))``, where the in-block
  sum adds the block's second half to its first, elementwise, and halves again (a fixed order);
- ``v = exp(x - m) / (s * scale)`` with one correctly rounded division (``div_rn`` in Triton,
  whose plain ``/`` is approximate on CUDA), then ``q`` from ``v``: ``torch.round`` here, an
  exact floor-based half-to-even in the kernel (``floor(v + 0.5)`` would round ties up, and
  0.49999997 + 0.5 rounds to 1 in float32).

Every step is a single IEEE float32 operation, so the kernel, launched without FMA contraction,
reproduces it (:mod:`lmcompress.kernels.int8_softmax`). ``p`` is within ~1e-6 (relative) of
``torch.softmax``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from lmcompress.errors import ConfigError
from lmcompress.kernels.softmax_constants import (
    BLOCK,
    DEFAULT_SCALE,
    EXP2_COEFFS,
    LOG2E,
    MASKED_AT,
    MIN_EXP_ARG,
)


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


# The 8-bit softmax (module doc)


def exp_reference(x: torch.Tensor) -> torch.Tensor:
    """``exp(x)`` of float32 ``x <= 0`` as the kernel computes it (see the module doc)."""
    return _exp_(x.clone(), torch.empty_like(x), torch.empty_like(x))


def _exp_(t: torch.Tensor, work: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    """:func:`exp_reference` of ``t`` into ``result``, clobbering ``t`` and ``work`` (float32,
    same shape). In-place steps round exactly as out-of-place ones: fresh tensors of attention
    size cost more than the arithmetic on this CPU."""
    t.clamp_(min=MIN_EXP_ARG).mul_(LOG2E)
    n = torch.floor(t, out=work)
    f = t.sub_(n)  # exact, in [0, 1)
    pow2 = n.add_(127.0).view(torch.int32)
    pow2.copy_(n)  # same bits read as int32 after the float -> int conversion (exact: integers)
    pow2.bitwise_left_shift_(23)  # n = -127 gives +0.0
    p = torch.mul(f, EXP2_COEFFS[6], out=result).add_(EXP2_COEFFS[5])
    for c in EXP2_COEFFS[4::-1]:
        p.mul_(f).add_(c)
    return p.mul_(pow2.view(torch.float32))


def pairwise_sum(e: torch.Tensor) -> torch.Tensor:
    """Sum over the last dimension (a power of two) in a fixed order: the first half plus the
    second half, elementwise, repeated until one element is left."""
    while e.shape[-1] > 1:
        half = e.shape[-1] // 2
        e = e[..., :half] + e[..., half:]
    return e[..., 0]


def int8_softmax_reference(
    scores: torch.Tensor,
    mask: torch.Tensor | None = None,
    offset: torch.Tensor | None = None,
    scale: float = DEFAULT_SCALE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8-bit softmax's specification (module doc): ``(q uint8, out float32)``, both shaped
    like ``scores``."""
    q, out, _ = int8_softmax_values(scores, mask, offset, scale)
    return q, out


def int8_softmax_values(scores, mask, offset, scale, keep_values=False):
    """:func:`int8_softmax_reference`, plus ``v = p / scale`` before rounding if asked (tests)."""
    check_int8_softmax(scores, mask, offset, scale)
    s4 = as_4d(scores)
    shape = s4.shape  # (B, H, Tq, Tk)
    keys = shape[-1]
    n_rows, n_blocks = shape[:-1].numel(), -(-keys // BLOCK)
    # x = scores + mask in float32, padded with -inf (exp gives 0) to whole blocks of columns.
    padded = scores.new_full((*shape[:-1], n_blocks * BLOCK), float("-inf"), dtype=torch.float32)
    x = padded[..., :keys]  # (B, H, Tq, Tk), a view
    x.copy_(s4)
    allowed = None
    if mask is not None:
        mk = as_4d(as_additive(mask))
        x.add_(mk)
        allowed = mk > MASKED_AT  # broadcast shape: small
    allowed = x > float("-inf") if allowed is None else allowed & (x > float("-inf"))
    blocks = padded.view(n_rows, n_blocks, BLOCK)
    work = (torch.empty_like(blocks), torch.empty_like(blocks), torch.empty_like(blocks))

    # Pass 1, online: the running max after each block, and the sum rescaled block by block.
    running = blocks.amax(-1).cummax(-1).values  # (R, nb)
    running_safe = running.masked_fill(running == float("-inf"), 0.0)
    e = _exp_(torch.sub(blocks, running_safe[..., None], out=work[0]), work[1], work[2])
    block_sums = pairwise_sum(e)  # (R, nb)
    s = blocks.new_zeros(n_rows)
    previous = blocks.new_full((n_rows,), float("-inf"))
    for j in range(n_blocks):
        s = s * exp_reference(previous - running_safe[:, j]) + block_sums[:, j]
        previous = running[:, j]

    # Pass 2: v = exp(x - m) / (s scale), rounded half to even, with the final max and sum.
    denom = s * torch.tensor(scale, dtype=torch.float32)
    denom = torch.where(denom > 0, denom, 1.0)  # empty rows: every e is 0, so v = 0
    e = _exp_(torch.sub(blocks, running_safe[:, -1:, None], out=work[0]), work[1], work[2])
    v = e.div_(denom[:, None, None])  # (R, nb, BLOCK)
    values = v.view(padded.shape)[..., :keys].clone() if keep_values else None
    q = v.round_().clamp_(max=255.0)
    out = torch.mul(q, torch.tensor(scale, dtype=torch.float32), out=work[0])
    q, out = q.view(padded.shape)[..., :keys], out.view(padded.shape)[..., :keys]  # (B, H, Tq, Tk)
    off = offset_2d(offset, scores, shape)[..., None, None]  # (B, H, 1, 1)
    out.add_(torch.where(allowed, off, 0.0))
    if values is not None:
        values = values.view(scores.shape)
    return q.to(torch.uint8).view(scores.shape), out.contiguous().view(scores.shape), values


def check_int8_softmax(
    scores: torch.Tensor, mask: torch.Tensor | None, offset: torch.Tensor | None, scale: float
) -> None:
    """One-line errors for impossible inputs (shapes only: safe on fake tensors)."""
    if not 2**-32 <= scale <= 1.0:  # also rejects 0, negatives and NaN
        raise ConfigError(f"int8_softmax: scale must be in [2**-32, 1], got {scale}")
    if not 2 <= scores.dim() <= 4 or not scores.dtype.is_floating_point:
        raise ConfigError(
            f"int8_softmax: scores must be float with 2 to 4 dimensions (..., Tq, Tk), got "
            f"{scores.dtype} {tuple(scores.shape)}"
        )
    if mask is not None and not _broadcasts(mask.shape, scores.shape):
        raise ConfigError(
            f"int8_softmax: mask {tuple(mask.shape)} does not broadcast to the scores "
            f"{tuple(scores.shape)}"
        )
    if offset is not None and not (
        offset.numel() == 1 or _broadcasts(offset.shape, scores.shape[:-2])
    ):
        raise ConfigError(
            f"int8_softmax: offset {tuple(offset.shape)} does not broadcast to the row groups "
            f"{tuple(scores.shape[:-2])} (one value per layer, (H,) per head, or (B, H))"
        )


def _broadcasts(shape: torch.Size, target: torch.Size) -> bool:
    if len(shape) > len(target):
        return False
    return all(a in (1, b) for a, b in zip(reversed(shape), reversed(target), strict=False))


def as_4d(t: torch.Tensor) -> torch.Tensor:
    """``(Tq, Tk)`` -> ``(1, 1, Tq, Tk)``, ``(H, Tq, Tk)`` -> ``(1, H, Tq, Tk)`` (a view)."""
    return t[(None,) * (4 - t.dim())]


def as_additive(mask: torch.Tensor) -> torch.Tensor:
    """Boolean masks (True = attend, sdpa's convention) as additive float32: 0 or ``-inf``."""
    if mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, device=mask.device).masked_fill(~mask, float("-inf"))


def offset_2d(
    offset: torch.Tensor | None, scores: torch.Tensor, shape4: torch.Size
) -> torch.Tensor:
    """The offset as a float32 ``(B, H)`` view (zeros when there is none)."""
    batch_heads = shape4[:2]
    if offset is None:
        return torch.zeros(batch_heads, device=scores.device)
    off = offset.to(device=scores.device, dtype=torch.float32)
    if off.numel() == 1:
        return off.reshape(1, 1).expand(batch_heads)
    return as_4d(off.expand(scores.shape[:-2])[..., None, None])[..., 0, 0]
