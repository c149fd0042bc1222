"""``torch.ops.lmcompress.int8_softmax``: a row softmax that writes 8-bit probabilities and their
bias-corrected dequantization (issue 11, the softmax bias correction's deployment form).

For scores ``(B, H, Tq, Tk)`` (2-D and 3-D scores read as ``(1, 1, ·, ·)`` and ``(1, H, ·, ·)``),
an additive ``mask`` broadcastable to them, a per-row-group ``offset`` broadcastable to ``(B, H)``
(per layer: one value; per head: ``(H,)``) and a ``scale``:

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
reproduces it: bit for bit in Triton's interpreter (tests/kernels/test_int8_softmax.py); on CUDA
by the same argument, not yet run on a GPU. ``p`` is within ~1e-6 (relative) of
``torch.softmax``. The op has no autograd formula (rounding has no useful gradient).

This file has no ``from __future__ import annotations``: ``custom_op`` reads the real annotations.
"""

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
    """The specification (module doc): ``(q uint8, out float32)``, both shaped like ``scores``."""
    q, out, _ = _reference(scores, mask, offset, scale)
    return q, out


def _reference(scores, mask, offset, scale, keep_values=False):
    """:func:`int8_softmax_reference`, plus ``v = p / scale`` before rounding if asked (tests)."""
    _check(scores, mask, offset, scale)
    s4 = _as_4d(scores)
    shape = s4.shape  # (B, H, Tq, Tk)
    keys = shape[-1]
    n_rows, n_blocks = shape[:-1].numel(), -(-keys // BLOCK)
    # x = scores + mask in float32, padded with -inf (exp gives 0) to whole blocks of columns.
    padded = scores.new_full((*shape[:-1], n_blocks * BLOCK), float("-inf"), dtype=torch.float32)
    x = padded[..., :keys]  # (B, H, Tq, Tk), a view
    x.copy_(s4)
    allowed = None
    if mask is not None:
        mk = _as_4d(_as_additive(mask))
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
    off = _offset_2d(offset, scores, shape)[..., None, None]  # (B, H, 1, 1)
    out.add_(torch.where(allowed, off, 0.0))
    if values is not None:
        values = values.view(scores.shape)
    return q.to(torch.uint8).view(scores.shape), out.contiguous().view(scores.shape), values


@torch.library.custom_op("lmcompress::int8_softmax", mutates_args=())
def int8_softmax(
    scores: torch.Tensor,
    mask: torch.Tensor | None = None,
    offset: torch.Tensor | None = None,
    scale: float = DEFAULT_SCALE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """8-bit softmax over the last dimension: ``(q uint8, out float32)`` (module doc).

    CPU and any device without a kernel: :func:`int8_softmax_reference`; CUDA: the Triton kernel
    (:func:`int8_softmax_triton`), equal to it bit for bit.
    """
    return int8_softmax_reference(scores, mask, offset, scale)


@int8_softmax.register_fake
def _int8_softmax_fake(scores, mask=None, offset=None, scale=DEFAULT_SCALE):
    _check(scores, mask, offset, scale)
    return scores.new_empty(scores.shape, dtype=torch.uint8), scores.new_empty(
        scores.shape, dtype=torch.float32
    )


@int8_softmax.register_kernel("cuda")
def _int8_softmax_cuda(scores, mask=None, offset=None, scale=DEFAULT_SCALE):
    return int8_softmax_triton(scores, mask, offset, scale)


def int8_softmax_triton(
    scores: torch.Tensor,
    mask: torch.Tensor | None = None,
    offset: torch.Tensor | None = None,
    scale: float = DEFAULT_SCALE,
    rows_per_program: int = 16,
    values: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the Triton kernel (CUDA tensors, or CPU tensors when ``TRITON_INTERPRET=1`` was set
    before :mod:`lmcompress.kernels.triton_softmax` was first imported). Same contract as
    :func:`int8_softmax_reference`; ``values``, a contiguous float32 tensor shaped like
    ``scores``, receives ``v = p / scale`` before rounding (for tests)."""
    from lmcompress.kernels.triton_softmax import int8_softmax_kernel  # imports triton

    _check(scores, mask, offset, scale)
    if rows_per_program < 1 or rows_per_program & (rows_per_program - 1):
        raise ConfigError(f"rows_per_program must be a power of two, got {rows_per_program}")
    s4 = _as_4d(scores)  # (B, H, Tq, Tk), a view
    batch, heads, queries, keys = s4.shape
    n_rows = batch * heads * queries
    q = torch.empty(s4.shape, dtype=torch.uint8, device=scores.device)
    out = torch.empty(s4.shape, dtype=torch.float32, device=scores.device)
    if n_rows == 0 or keys == 0:
        return q.view(scores.shape), out.view(scores.shape)
    m4 = None if mask is None else _as_4d(_as_additive(mask).expand(scores.shape))
    off = None if offset is None else _offset_2d(offset, scores, s4.shape)  # (B, H) view
    grid = (-(-n_rows // rows_per_program),)
    int8_softmax_kernel[grid](
        s4,
        s4 if m4 is None else m4,  # a placeholder pointer when there is no mask
        s4 if off is None else off,
        q,
        out,
        n_rows,
        keys,
        heads,
        queries,
        *s4.stride(),
        *(m4.stride() if m4 is not None else (0, 0, 0, 0)),
        *(off.stride() if off is not None else (0, 0)),
        float(scale),
        q if values is None else values,  # placeholder pointer when not stored
        HAS_MASK=m4 is not None,
        HAS_OFFSET=off is not None,
        ROWS=rows_per_program,
        BLOCK_COLS=BLOCK,
        STORE_V=values is not None,
        enable_fp_fusion=False,  # no FMA contraction: each op rounds as in the reference
    )
    return q.view(scores.shape), out.view(scores.shape)


def _check(
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


def _as_4d(t: torch.Tensor) -> torch.Tensor:
    """``(Tq, Tk)`` -> ``(1, 1, Tq, Tk)``, ``(H, Tq, Tk)`` -> ``(1, H, Tq, Tk)`` (a view)."""
    return t[(None,) * (4 - t.dim())]


def _as_additive(mask: torch.Tensor) -> torch.Tensor:
    """Boolean masks (True = attend, sdpa's convention) as additive float32: 0 or ``-inf``."""
    if mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, device=mask.device).masked_fill(~mask, float("-inf"))


def _offset_2d(
    offset: torch.Tensor | None, scores: torch.Tensor, shape4: torch.Size
) -> torch.Tensor:
    """The offset as a float32 ``(B, H)`` view (zeros when there is none)."""
    batch_heads = shape4[:2]
    if offset is None:
        return torch.zeros(batch_heads, device=scores.device)
    off = offset.to(device=scores.device, dtype=torch.float32)
    if off.numel() == 1:
        return off.reshape(1, 1).expand(batch_heads)
    return _as_4d(off.expand(scores.shape[:-2])[..., None, None])[..., 0, 0]
