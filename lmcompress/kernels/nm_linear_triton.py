"""Triton code of ``lmcompress::nm_linear``: ``y = x @ Wᵀ (+ bias)`` read straight from the packed
N:M layout of :mod:`lmcompress.kernels.reference` (kept values plus their packed positions), never
from a dense copy of ``W``.

Importing this module imports triton and decorates the kernel: import it lazily (``ops.py`` does,
inside the CUDA implementation), and set ``TRITON_INTERPRET=1`` before the first import to run it
on CPU tensors.

One kernel, :func:`nm_matmul_kernel`, tiles ``y (tokens, out)`` in ``BLOCK_M × BLOCK_N`` and walks
``K`` (in features) ``BLOCK_K`` dense columns at a time. Each step loads the ``x`` tile, the
``BLOCK_N × BLOCK_K·n/m`` tile of kept values and the bytes of their positions, expands the weight
tile to dense in registers and feeds ``tl.dot`` (fp32 accumulation). Two expansions:

- *fast* (``n`` in 1, 2, 4 and ``m`` in 2, 4, 8, which covers 2:4): the values and position bytes
  are loaded as compact, contiguous tiles; the bytes are split into codes with shifts, the codes
  and values are split into their ``n`` slots per group (``tl.split``), and each dense column
  ``r`` of a group takes the value whose code is ``r`` (a ``tl.where`` per slot);
- *general* (any other ``m <= 8``, e.g. 3:7): a dense column ``k`` reads, for each of the ``n``
  slots of its group, the value and position byte at its packed address (repeated addresses,
  served from cache) and keeps the value whose code is ``k % m``.

Few tokens (decode, ``tokens <= DECODE_TOKENS``) use the same kernel with ``BLOCK_M = 16`` (the
smallest ``tl.dot``; the padded rows cost tensor-core cycles a bandwidth-bound step has to spare)
and split-K: ``out / BLOCK_N`` programs alone leave most of a GPU idle, so ``K`` is cut into
``split_k`` slices whose fp32 partial sums are added by one ``sum`` afterwards (deterministic,
unlike atomics). There the win is bandwidth: the packed 2:4 weight is 56 % of the dense bytes.
"""

import functools
import logging
import math

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from lmcompress.errors import ConfigError
from lmcompress.kernels.reference import index_bits

log = logging.getLogger(__name__)

MAX_M = 8  # packed layouts the kernel reads; larger M run the reference (unpack + matmul)
DECODE_TOKENS = 16  # up to this many tokens: the decode configurations and split-K
# One configuration for the interpreter (no autotuning without a driver): big tiles, since the
# interpreter's cost is per operation, not per element.
INTERPRETER_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 8}


@triton.jit
def _place(dense, codes, vals, r):
    """``dense (BN, G, m)`` with column ``r`` of each group set to ``vals`` where ``codes == r``."""
    return tl.where(codes[:, :, None] == r, vals[:, :, None], dense)


@triton.jit
def _expand(
    vals, codes, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, N: tl.constexpr, M: tl.constexpr
):
    """Kept values and their codes ``(BLOCK_N, GROUPS·N)`` -> the dense tile ``(BLOCK_N,
    GROUPS·M)``; ``N`` in 1, 2, 4, ``M`` a power of two."""
    r = tl.arange(0, M).to(tl.uint8)[None, None, :]  # codes stay 8-bit: fewer registers
    dense = tl.zeros((BLOCK_N, GROUPS, M), dtype=vals.dtype)
    if N == 1:
        dense = _place(
            dense, tl.reshape(codes, (BLOCK_N, GROUPS)), tl.reshape(vals, (BLOCK_N, GROUPS)), r
        )
    elif N == 2:
        v0, v1 = tl.split(tl.reshape(vals, (BLOCK_N, GROUPS, 2)))  # slots 0 and 1 of each group
        c0, c1 = tl.split(tl.reshape(codes, (BLOCK_N, GROUPS, 2)))
        dense = _place(_place(dense, c0, v0, r), c1, v1, r)
    else:
        va, vb = tl.split(tl.reshape(vals, (BLOCK_N, GROUPS, 2, 2)))  # slots (0, 2) and (1, 3)
        ca, cb = tl.split(tl.reshape(codes, (BLOCK_N, GROUPS, 2, 2)))
        v0, v2 = tl.split(va)
        v1, v3 = tl.split(vb)
        c0, c2 = tl.split(ca)
        c1, c3 = tl.split(cb)
        dense = _place(_place(dense, c0, v0, r), c1, v1, r)
        dense = _place(_place(dense, c2, v2, r), c3, v3, r)
    return tl.reshape(dense, (BLOCK_N, GROUPS * M))


@triton.jit
def _weight_tile(
    v_ptr,
    i_ptr,
    rn,
    kt,
    out_features,
    in_features,
    s_vn,
    s_vk,
    s_in,
    s_ik,
    N: tl.constexpr,
    M: tl.constexpr,
    BITS: tl.constexpr,
    FAST: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The dense ``(BLOCK_N, BLOCK_K)`` tile of ``W`` at rows ``rn``, columns from ``kt·BLOCK_K``
    (zeros outside ``W``), from the packed values and positions."""
    PER_BYTE: tl.constexpr = 8 // BITS
    row_ok = rn[:, None] < out_features
    if FAST:
        KEPT: tl.constexpr = BLOCK_K * N // M  # kept values in the tile (a whole number of bytes)
        BYTES: tl.constexpr = KEPT // PER_BYTE
        kept = in_features // M * N
        j = kt * KEPT + tl.arange(0, KEPT)
        vals = tl.load(
            v_ptr + rn[:, None] * s_vn + j[None, :] * s_vk, row_ok & (j < kept)[None, :], other=0.0
        )
        b = kt * BYTES + tl.arange(0, BYTES)
        n_bytes = (kept + PER_BYTE - 1) // PER_BYTE
        packed = tl.load(
            i_ptr + rn[:, None] * s_in + b[None, :] * s_ik, row_ok & (b < n_bytes)[None, :], other=0
        )
        shifts = (tl.arange(0, PER_BYTE) * BITS).to(tl.uint8)[None, None, :]
        codes = (packed[:, :, None] >> shifts) & ((1 << BITS) - 1)  # (BN, BYTES, PB) uint8
        codes = tl.reshape(codes, (BLOCK_N, KEPT))  # low bits first: in kept order
        w = _expand(vals, codes, BLOCK_N, BLOCK_K // M, N, M)
    else:
        k = kt * BLOCK_K + tl.arange(0, BLOCK_K)
        ok = row_ok & (k < in_features)[None, :]
        first = (k // M) * N  # packed index of slot 0 of each column's group
        r = (k % M)[None, :]
        w = tl.zeros((BLOCK_N, BLOCK_K), dtype=v_ptr.dtype.element_ty)
        for t in tl.static_range(N):
            j = first + t
            v = tl.load(v_ptr + rn[:, None] * s_vn + j[None, :] * s_vk, ok, other=0.0)
            packed = tl.load(
                i_ptr + rn[:, None] * s_in + (j // PER_BYTE)[None, :] * s_ik, ok, other=0
            )
            code = (packed.to(tl.int32) >> ((j % PER_BYTE) * BITS)[None, :]) & ((1 << BITS) - 1)
            w = tl.where(code == r, v, w)
    return w


@triton.jit
def nm_matmul_kernel(
    x_ptr,
    v_ptr,
    i_ptr,
    b_ptr,
    y_ptr,
    tokens,
    out_features,
    in_features,
    tokens_bucket,  # noqa: ARG001  (only an autotuning key: next power of two of tokens)
    s_xm,
    s_xk,
    s_vn,
    s_vk,
    s_in,
    s_ik,
    s_ys,
    s_ym,
    s_yn,
    N: tl.constexpr,
    M: tl.constexpr,
    BITS: tl.constexpr,
    FAST: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """``y = x Wᵀ (+ bias)`` for ``x (tokens, in)``, ``W (out, in)`` packed N:M; program
    ``(tile, s)`` computes one ``(BLOCK_M, BLOCK_N)`` tile of ``y`` over K slice ``s``.

    ``SPLIT_K == 1``: ``y (tokens, out)`` in its dtype, bias added. Otherwise ``y (SPLIT_K,
    tokens, out)`` float32 partial sums, no bias (the wrapper adds them up).
    """
    # Tiles in groups of GROUP_M rows of tiles, so that programs running together share W tiles
    # in L2 (the Triton matmul tutorial's ordering).
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(tokens, BLOCK_M)
    tiles_n = tl.cdiv(out_features, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    rows_in_group = min(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows_in_group
    pid_n = (pid % per_group) // rows_in_group
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # (BM,)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)  # (BN,)

    k_tiles = tl.cdiv(in_features, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    k_start = tl.program_id(1) * per_split
    k_stop = min(k_start + per_split, k_tiles)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(k_start, k_stop):
        k = kt * BLOCK_K + tl.arange(0, BLOCK_K)
        x_ok = (rm[:, None] < tokens) & (k[None, :] < in_features)
        x = tl.load(x_ptr + rm[:, None] * s_xm + k[None, :] * s_xk, x_ok, other=0.0)  # (BM, BK)
        w = _weight_tile(
            v_ptr, i_ptr, rn, kt, out_features, in_features, s_vn, s_vk, s_in, s_ik,
            N, M, BITS, FAST, BLOCK_N, BLOCK_K,
        )  # (BN, BK)  # fmt: skip
        if UPCAST:  # bf16 in the interpreter, which multiplies bf16 wrongly
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        else:
            w = w.to(x.dtype)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)  # (BM, BN)

    y_ok = (rm[:, None] < tokens) & (rn[None, :] < out_features)
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, rn < out_features, other=0.0).to(tl.float32)[None, :]
        where = y_ptr + rm[:, None] * s_ym + rn[None, :] * s_yn
        tl.store(where, acc.to(y_ptr.dtype.element_ty), y_ok)
    else:
        where = y_ptr + tl.program_id(1) * s_ys + rm[:, None] * s_ym + rn[None, :] * s_yn
        tl.store(where, acc, y_ok)


def _configs(decode: bool, arch: int = 90) -> list[triton.Config]:
    """GPU autotuning candidates for compute capability ``arch`` (80: A100; 90: H100/H200),
    each compiled without a register spill there (``ptx_report``: ``ptxas -v`` of every
    candidate on both, checked by ``tests/kernels/test_ptx_report.py``). The in-register
    expansion is register-hungry: the big tiles get 8 warps, and sm_80's compiler, which
    spilled the largest tiles of sm_90's list (``benchmarks/results/ptx_report.md``), gets
    smaller ones instead."""
    if decode:  # BLOCK_M = 16: the smallest tl.dot; the K slices are long to stream the weight
        shapes = [(16, 32, 128, 4, 4), (16, 64, 128, 4, 4), (16, 64, 64, 4, 4)]
        shapes += [(16, 32, 256, 4, 3), (16, 32, 64, 2, 4)]
        if arch >= 90:
            shapes += [(16, 128, 64, 4, 4), (16, 128, 128, 8, 3), (16, 256, 64, 8, 3)]
        else:
            shapes += [(16, 128, 64, 8, 4), (16, 64, 256, 8, 3)]
    else:
        shapes = [(64, 128, 64, 8, 3), (128, 128, 32, 8, 4)]
        if arch >= 90:
            shapes += [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 64, 64, 8, 3)]
        else:
            shapes += [(64, 64, 64, 8, 3), (64, 128, 32, 4, 4)]
    return [
        triton.Config(
            {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8},
            num_warps=warps,
            num_stages=stages,
        )
        for bm, bn, bk, warps, stages in shapes
    ]


@functools.cache
def _autotuned(decode: bool, arch: int = 90):
    key = ["out_features", "in_features", "tokens_bucket", "N", "M", "SPLIT_K", "HAS_BIAS"]
    return triton.autotune(configs=_configs(decode, arch), key=key)(nm_matmul_kernel)


def _tuning_arch(device: torch.device) -> int:
    """Which of :func:`_configs`' lists ``device`` autotunes over: 80 below compute capability
    9 (A100-class), else 90 (and in the interpreter)."""
    if device.type != "cuda":
        return 90
    return 90 if torch.cuda.get_device_capability(device)[0] >= 9 else 80


def interpreted() -> bool:
    """Whether the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1`` at import)."""
    return isinstance(nm_matmul_kernel, InterpretedFunction)


def fast_path(n: int, m: int) -> bool:
    """Whether ``n:m`` is expanded with compact tile loads (see the module doc)."""
    return n in (1, 2, 4) and m in (2, 4, 8) and n < m


def split_k_for(tokens: int, out_features: int, in_features: int, device: torch.device) -> int:
    """K slices of a decode step: enough programs for about two per SM at ``BLOCK_N = 64``, a
    power of two up to 16, each slice at least 256 columns; 1 above ``DECODE_TOKENS``."""
    if tokens > DECODE_TOKENS or device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    tiles = triton.cdiv(out_features, 64)
    wanted = max(1, min(16, 2 * sms // tiles, in_features // 256))
    return 1 << (wanted.bit_length() - 1)


def nm_linear_triton(
    x: torch.Tensor,
    values: torch.Tensor,
    indices: torch.Tensor,
    n: int,
    m: int,
    in_features: int,
    bias: torch.Tensor | None = None,
    *,
    config: dict[str, int] | None = None,
    split_k: int | None = None,
    upcast: bool | None = None,
) -> torch.Tensor:
    """Launch the kernel: the contract of :func:`lmcompress.kernels.reference.nm_linear` for
    ``m <= MAX_M`` (``x (..., in)`` in fp16, bf16 or fp32 -> ``(..., out)`` in ``x``'s dtype).

    CUDA tensors, or CPU tensors in the interpreter. ``config`` (``BLOCK_M``, ``BLOCK_N``,
    ``BLOCK_K``, ``GROUP_M``) fixes the tiles instead of autotuning (the interpreter's default is
    :data:`INTERPRETER_CONFIG`); ``split_k`` the K slices (default :func:`split_k_for`);
    ``upcast`` multiplies in fp32 after loading (default: for bf16 in the interpreter).
    """
    _check(x, values, indices, n, m, in_features, bias)
    x2 = x.reshape(-1, in_features)  # (T, K), a view where the strides allow
    tokens, out_features = x2.shape[0], values.shape[0]
    y = torch.empty(tokens, out_features, dtype=x.dtype, device=x.device)
    if tokens == 0 or out_features == 0 or in_features == 0:
        y = y.zero_() if bias is None else y.copy_(bias.to(x.dtype).expand_as(y))
        return y.reshape(*x.shape[:-1], out_features)
    if interpreted() and config is None:
        config = INTERPRETER_CONFIG
    if split_k is None:
        split_k = split_k_for(tokens, out_features, in_features, x.device)
    if upcast is None:
        upcast = interpreted() and x.dtype == torch.bfloat16
    target = y if split_k == 1 else y.new_empty(split_k, tokens, out_features, dtype=torch.float32)
    y_strides = (0, *y.stride()) if split_k == 1 else target.stride()
    args = (x2, values, indices, values if bias is None else bias, target)
    args += (tokens, out_features, in_features, 1 << max(0, tokens - 1).bit_length())
    args += (*x2.stride(), *values.stride(), *indices.stride(), *y_strides)
    options = {
        "N": n,
        "M": m,
        "BITS": index_bits(m),
        "FAST": fast_path(n, m),
        "HAS_BIAS": bias is not None,
        "SPLIT_K": split_k,
        "UPCAST": upcast,
        "PRECISION": "ieee" if x.dtype == torch.float32 else "tf32",  # fp32: no TF32 rounding
    }

    def grid(meta):
        tiles = triton.cdiv(tokens, meta["BLOCK_M"]) * triton.cdiv(out_features, meta["BLOCK_N"])
        return (tiles, split_k)

    if config is not None:
        _check_config(config, n, m)
        nm_matmul_kernel[grid](*args, **options, **config)
    else:
        _autotuned(tokens <= DECODE_TOKENS, _tuning_arch(x.device))[grid](*args, **options)
    if split_k > 1:  # (S, T, out) fp32 partial sums
        y = target.sum(0)
        if bias is not None:
            y += bias.to(torch.float32)
        y = y.to(x.dtype)
    return y.reshape(*x.shape[:-1], out_features)


def _check(x, values, indices, n, m, in_features, bias) -> None:
    """One-line errors for what the kernel cannot read (shapes and dtypes only)."""
    if not 0 < n < m <= MAX_M:
        raise ConfigError(f"nm_linear kernel: needs 0 < N < M <= {MAX_M}, got {n}:{m}")
    if in_features % m or x.shape[-1] != in_features:
        raise ConfigError(
            f"nm_linear kernel: input has {x.shape[-1]} features, the layer {in_features} "
            f"(a multiple of M={m})"
        )
    kept = in_features // m * n
    if values.dim() != 2 or values.shape[1] != kept:
        raise ConfigError(f"nm_linear kernel: values {tuple(values.shape)} do not hold {n}:{m}")
    want = (values.shape[0], math.ceil(kept * index_bits(m) / 8))
    if indices.dtype != torch.uint8 or tuple(indices.shape) != want:
        raise ConfigError(
            f"nm_linear kernel: indices must be uint8 {want}, got {indices.dtype} "
            f"{tuple(indices.shape)}"
        )
    floats = (torch.float16, torch.bfloat16, torch.float32)
    if x.dtype not in floats or values.dtype not in floats:
        raise ConfigError(
            f"nm_linear kernel: x and values must be fp16, bf16 or fp32, got {x.dtype} and "
            f"{values.dtype}"
        )
    if bias is not None and tuple(bias.shape) != (values.shape[0],):
        raise ConfigError(
            f"nm_linear kernel: bias {tuple(bias.shape)} for {values.shape[0]} outputs"
        )


def _check_config(config: dict[str, int], n: int, m: int) -> None:
    sizes = [config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]]
    if any(s < 16 or s & (s - 1) for s in sizes):
        raise ConfigError(f"nm_linear kernel: blocks must be powers of two >= 16, got {sizes}")
    if fast_path(n, m) and config["BLOCK_K"] * n // m % (8 // index_bits(m)):
        raise ConfigError(f"nm_linear kernel: BLOCK_K={config['BLOCK_K']} splits a position byte")
