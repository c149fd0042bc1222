"""Triton code of ``lmcompress::int8_softmax`` (the specification, and why the arithmetic is
spelled out op by op, is in :mod:`lmcompress.kernels.int8_softmax`).

Importing this module imports triton and decorates the kernels: import it lazily, and set
``TRITON_INTERPRET=1`` before the import to run the kernels on CPU tensors (the variable is read
when ``@triton.jit`` runs). Everything here uses only IEEE-exact operations (``+ - *``, ``floor``,
``maximum``, ``div_rn``, bit casts), each rounded on its own: launch with
``enable_fp_fusion=False`` so that no multiply-add is contracted into an FMA, and the result
equals the torch reference bit for bit.
"""

import triton
import triton.language as tl

from lmcompress.kernels.softmax_constants import BLOCK, EXP2_COEFFS, LOG2E, MASKED_AT, MIN_EXP_ARG

_LOG2E = tl.constexpr(LOG2E)
_MIN_X = tl.constexpr(MIN_EXP_ARG)
_MASKED_AT = tl.constexpr(MASKED_AT)
_C0 = tl.constexpr(EXP2_COEFFS[0])
_C1 = tl.constexpr(EXP2_COEFFS[1])
_C2 = tl.constexpr(EXP2_COEFFS[2])
_C3 = tl.constexpr(EXP2_COEFFS[3])
_C4 = tl.constexpr(EXP2_COEFFS[4])
_C5 = tl.constexpr(EXP2_COEFFS[5])
_C6 = tl.constexpr(EXP2_COEFFS[6])
_LEVELS = tl.constexpr(BLOCK.bit_length() - 1)  # log2(BLOCK) halvings in the block sum


@triton.jit
def exp_poly(x):
    """``exp(x)`` for ``x <= 0`` (``-inf`` gives 0): ``2**n * P(f)`` with ``t = x log2(e)``,
    ``n = floor(t)``, ``f = t - n``; results below ``2**-126`` flush to 0."""
    t = tl.maximum(x, _MIN_X) * _LOG2E
    n = tl.floor(t)
    f = t - n  # exact, in [0, 1)
    p = _C6 * f + _C5
    p = p * f + _C4
    p = p * f + _C3
    p = p * f + _C2
    p = p * f + _C1
    p = p * f + _C0
    pow2 = ((n.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)  # n = -127 gives +0.0
    return p * pow2


@triton.jit
def round_half_even(v):
    """Round ``v >= 0`` to the nearest integer, ties to even (``torch.round``), exactly."""
    r = tl.floor(v)
    d = v - r  # exact
    odd = (r - 2.0 * tl.floor(r * 0.5)) == 1.0
    up = (d > 0.5) | ((d == 0.5) & odd)
    return r + tl.where(up, 1.0, 0.0)


@triton.jit
def _pairwise_sum(e, ROWS: tl.constexpr):
    """Row sums of ``e (ROWS, BLOCK)`` by halving: second half added to the first, repeated, so
    that the order of the additions is fixed (``tl.sum``'s over many elements is not; over an
    axis of two it is the one addition)."""
    for _ in tl.static_range(_LEVELS):
        e = tl.sum(tl.reshape(e, (ROWS, 2, e.shape[1] // 2)), axis=1)
    return tl.reshape(e, (ROWS,))


@triton.jit
def _load_logits(scores_ptr, mask_ptr, s_row, m_row, cols, ok, s_sk, m_sk, HAS_MASK: tl.constexpr):
    """``(scores + mask)`` of one tile in float32 (upcast right after loading), ``-inf`` outside
    the tensor, and the tile's mask in float32 (0 without one)."""
    x = tl.load(scores_ptr + s_row[:, None] + cols[None, :] * s_sk, mask=ok, other=float("-inf"))
    x = x.to(tl.float32)
    if HAS_MASK:
        mk = tl.load(mask_ptr + m_row[:, None] + cols[None, :] * m_sk, mask=ok, other=0.0)
        mk = mk.to(tl.float32)
        x = x + mk
    else:
        mk = tl.zeros_like(x)
    return x, mk


@triton.jit
def int8_softmax_kernel(
    scores_ptr,
    mask_ptr,
    offset_ptr,
    q_ptr,
    out_ptr,
    n_rows,
    n_cols,
    heads,
    queries,
    s_sb,
    s_sh,
    s_sq,
    s_sk,
    m_sb,
    m_sh,
    m_sq,
    m_sk,
    o_sb,
    o_sh,
    scale,
    v_ptr,
    HAS_MASK: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    STORE_V: tl.constexpr,
):
    """One program per ``ROWS`` rows of ``scores (B, H, Tq, Tk)``; row ``r`` is ``(b, h, i)``.

    Pass 1 (online, Milakov & Gimelshein): running max ``m`` and sum ``s`` of ``exp(x - m)``,
    rescaled by ``exp(m_old - m_new)`` when the max grows. Pass 2: ``v = exp(x - m) / (s scale)``,
    ``q = clamp(round_half_even(v), 0, 255)``, ``out = q scale + offset[b, h]`` where allowed.
    """
    pid = tl.program_id(0)
    rows = (pid * ROWS + tl.arange(0, ROWS)).to(tl.int64)  # (ROWS,)
    row_ok = rows < n_rows
    b = rows // (heads * queries)
    h = (rows // queries) % heads
    i = rows % queries
    s_row = b * s_sb + h * s_sh + i * s_sq
    m_row = b * m_sb + h * m_sh + i * m_sq
    cols0 = tl.arange(0, BLOCK_COLS)

    m = tl.full((ROWS,), float("-inf"), tl.float32)
    s = tl.zeros((ROWS,), tl.float32)
    for start in range(0, n_cols, BLOCK_COLS):
        cols = start + cols0
        ok = row_ok[:, None] & (cols[None, :] < n_cols)
        x, mk = _load_logits(scores_ptr, mask_ptr, s_row, m_row, cols, ok, s_sk, m_sk, HAS_MASK)
        m_new = tl.maximum(m, tl.max(x, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing yet
        s = s * exp_poly(m - m_safe) + _pairwise_sum(exp_poly(x - m_safe[:, None]), ROWS)
        m = m_new

    m_safe = tl.where(m == float("-inf"), 0.0, m)
    denom = s * scale
    denom = tl.where(denom > 0.0, denom, 1.0)  # empty rows: every e is 0, so v = 0
    if HAS_OFFSET:
        off = tl.load(offset_ptr + b * o_sb + h * o_sh, mask=row_ok, other=0.0)
    else:
        off = tl.zeros((ROWS,), tl.float32)
    out_row = rows * n_cols
    for start in range(0, n_cols, BLOCK_COLS):
        cols = start + cols0
        ok = row_ok[:, None] & (cols[None, :] < n_cols)
        x, mk = _load_logits(scores_ptr, mask_ptr, s_row, m_row, cols, ok, s_sk, m_sk, HAS_MASK)
        v = tl.math.div_rn(exp_poly(x - m_safe[:, None]), denom[:, None])
        q = tl.minimum(round_half_even(v), 255.0)
        allowed = (x > float("-inf")) & (mk > _MASKED_AT)
        out = q * scale + tl.where(allowed, off[:, None], 0.0)
        where = out_row[:, None] + cols[None, :]
        tl.store(q_ptr + where, q.to(tl.uint8), mask=ok)
        tl.store(out_ptr + where, out, mask=ok)
        if STORE_V:  # v = p / scale before rounding: what the tests compare bit for bit
            tl.store(v_ptr + where, v, mask=ok)
