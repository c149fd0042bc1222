"""The weight-only int4 (and int3, int8) linear on CPU: what ``Int4Linear.forward`` calls.

Storage (``int4_reference``'s module doc, the shared spec): codes ``q`` two a byte (one a byte at
8 bits), float32 ``scales`` and uint8 ``zeros`` per group of ``group_size`` input columns,
``W = (q - z) · s``; for packed N:M (``nm_packed_int4``) ``qweight`` holds the kept codes, packed
the same way over the kept axis, and ``nm = (indices, n, m)`` their positions
(``reference.pack_nm``'s layout).

:func:`linear` takes one of two paths:

- **decode** (at most ``MAX_TOKENS`` = 6 tokens, bits ≤ 4, fp32 or bf16 activations, eager on
  CPU, the kernels built): ``lmc_int4_linear`` reads the packed codes directly (codes held in
  :mod:`lmcompress.kernels.int4_tiles`' layout, ``tiled=True``: its kernel, up to 16 tokens,
  the same results; packed 2:4 codes where the vector loops are built: :mod:`~lmcompress.kernels.
  int4_tiles24`'). Each token's
  activations are quantized per weight group to **int16** (``absmax / 32767``), the group's
  products are exact integers on 16-bit lanes (AVX-512 ``vpdpwssd`` with VNNI, ``vpmaddwd`` +
  add without; AVX2 ``vpmaddwd`` on a CPU without AVX-512 BW/VL; a plain loop without either),
  and the float part (per group
  ``(D · s) · x_scale``, summed in group order, then the bias) is fixed, so the kernel equals
  :func:`int4_reference.decode_linear` bit for bit on every path.
- **prefill** (everything else): the weight is dequantized ``BLOCK_BYTES`` of output rows at a
  time into the matmul's dtype (by ``lmc_int4_dequant``, bit-identical to
  :func:`int4_reference.dequantize_any`; by torch where the kernel does not apply) and each block
  multiplied by torch's BLAS matmul (``F.linear``): never a whole-matrix dequantization. The
  matmul's dtype is the activations' except for bf16 on a CPU that emulates bf16 matmuls
  (:mod:`~lmcompress.kernels.gemm_dtype`): float32 there, the output rounded to bf16.

Why int16 activations and not int8 (``vpdpbusd``, twice the products an instruction): W4A16
means the activations keep their precision. Measured on SmolLM2's shapes
(``benchmarks/results/int4_speed.md``, max |y - y_float| / max |y_float| over 16 tokens against
the float dequantized matmul): int16 codes per group (what the kernel computes) 2e-5, 1e-4 with
one activation 100x the others; int8 codes per group (absmax / 127) 6e-3, and 2e-2 to 3e-2 with
the outlier; merely rounding the activations to bf16 2e-3 (4e-4 to 7e-4 with the outlier).
int8 activations would be 3-80x further from W4A16 than bf16's own rounding, and decode would
visibly disagree with prefill (float activations); int16 stays 4-90x inside bf16's rounding.
The price is two 16-bit multiply-adds per 64 weights instead of one 8-bit one: the kernel is
bound by its instructions on weights held in cache, by the weight bytes from memory.

Speed (``python -m benchmarks.int4_speed`` → ``benchmarks/results/int4_speed.md``, 2 threads of
an Intel Xeon with AMX and AVX-512 VNNI; medians; codes tiled, :mod:`int4_tiles`): batch-1
decode of SmolLM2's 576×576, 1536×576 and 576×1536 layers (group 64) 2.17, 3.28 and 2.76× the
faster dense ``F.linear`` (fp32 or bf16), 4.27 and 4.93× on 8192×2048 / 2048×8192 (group 128);
one pass over SmolLM2's 210 decoder linears 2.42× at one token; prefill of 512 tokens 0.71-0.95×
dense bf16.

Where there is no compiler (``cpu_kernels.library()`` is ``None``) or while ``torch.compile``
traces, every call takes the prefill path in torch ops: the same dequantized weight, float
activations (equal to the decode kernel to ~1e-5 relative, not bit for bit).
"""

from __future__ import annotations

import threading

import torch

from lmcompress.kernels import (
    cpu_kernels,
    gemm_dtype,
    int4_reference,
    int4_tiles,
    int4_tiles24,
    reference,
)

# The row kernel (codes in the stored layout) up to this many tokens: its cost grows with each
# token (16-bit products), the prefill path's hardly (one dequantization, then the bf16
# matmul). Over SmolLM2's 210 decoder linears in bf16, 2 threads (ms, row kernel / prefill,
# benchmarks/results/int4_speed.md): 4 tokens 18.95 / 26.40, 8 tokens 27.41 / 25.86.
MAX_TOKENS = 6
BLOCK_BYTES = 4 << 20  # dequantized weight per prefill block (stays in cache for the matmul)
# ...but never fewer output rows than this: at 1,024 tokens a block of 144 to 512 rows made
# the bf16 matmul of an 8B-shaped layer (4096 x 14336) about twice as slow as 1,024 rows,
# which cost no more than the whole weight at once (2 threads, Intel Xeon with AMX; ad hoc).
# Costs a buffer of 1,024 rows per thread: 29 MiB for a 14336-wide bf16 layer.
MIN_BLOCK_ROWS = 1024
KERNEL_DTYPES = (torch.float32, torch.bfloat16)

NM = tuple[torch.Tensor, int, int]  # (indices, n, m)


def linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    *,
    bits: int,
    group_size: int,
    in_features: int,
    bias: torch.Tensor | None = None,
    nm: NM | None = None,
    tiled: bool = False,
    grid16: tuple[torch.Tensor, torch.Tensor] | None = None,
    out_features: int | None = None,
) -> torch.Tensor:
    """``x @ Wᵀ + bias`` for ``x`` (..., in) and the packed weight (module doc): (..., out) in
    ``x``'s dtype. ``qweight`` uint8, ``scales`` float32 (out, groups), ``zeros`` uint8
    (out, groups), ``bias`` (out,) or ``None``; ``nm = (indices, n, m)`` for packed N:M kept
    codes (groups counted over the original columns; ``group_size`` a multiple of ``m``);
    ``tiled``: ``qweight`` is :func:`int4_tiles.tile`'s layout (with ``nm``: the packed 2:4
    codes in :mod:`int4_tiles24`' layout, ``nm[0]`` their patterns), ``grid16``
    the grid's :func:`int4_tiles.tile_grid` (computed where not given; where given, ``scales``
    and ``zeros`` may be ``None`` and ``out_features`` says the rows).
    Trusts its arguments (the format checks them at load)."""
    if x.shape[-1] != in_features:  # as nn.Linear: never a silent reshape into other rows
        raise ValueError(f"int4 linear: input {tuple(x.shape)}, {in_features} features expected")
    x2 = x if x.dim() == 2 else x.reshape(-1, in_features)
    if tiled:
        if grid16 is None:
            grid16 = int4_tiles.tile_grid(scales, zeros)
        out = scales.shape[0] if scales is not None else out_features
    if tiled and nm is not None:  # packed 2:4 in int4_tiles24's layout: indices its patterns
        buffers = {"qweight": qweight, "indices": nm[0], "scales16": grid16[0]}
        buffers |= {"zeros16": grid16[1], "bias": bias}
        y = int4_tiles24.try_decode(x2, buffers, in_features, out)
        if y is None:
            y = prefill_tiled24(x2, buffers, out, bits, group_size, in_features)
    elif tiled and use_decode_kernel(x2, bits, int4_tiles.MAX_TOKENS):
        y = int4_tiles.decode_grid16(x2, qweight, grid16, in_features, out, bias)
    elif tiled:
        y = prefill_tiled(x2, qweight, grid16, out, bits, group_size, in_features, bias)
    elif use_decode_kernel(x2, bits):
        y = decode(x2, qweight, scales, zeros, bits, group_size, in_features, bias, nm)
    else:
        y = prefill(x2, qweight, scales, zeros, bits, group_size, in_features, bias, nm)
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[1])


def use_decode_kernel(x2: torch.Tensor, bits: int, max_tokens: int = MAX_TOKENS) -> bool:
    """Whether :func:`linear` runs a compiled decode kernel on ``x2`` (tokens, in)."""
    return (
        x2.shape[0] <= max_tokens
        and bits <= 4
        and x2.dtype in KERNEL_DTYPES
        and _eager_cpu(x2)
        and cpu_kernels.library() is not None
    )


def _eager_cpu(x: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and not torch.compiler.is_compiling()
        and not (x.requires_grad and torch.is_grad_enabled())
    )


def _layout(group_size: int, in_features: int, nm: NM | None):
    width = int4_reference.group_width(group_size, in_features)
    if nm is None:
        return width, in_features // width, None, 0, 1, 1, 0
    indices, n, m = nm
    indices = indices.contiguous()
    return width, in_features // width, indices, indices.shape[1], n, m, _index_bits(m)


def _index_bits(m: int) -> int:
    return reference.index_bits(m)


def decode(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    bits: int,
    group_size: int,
    in_features: int,
    bias: torch.Tensor | None = None,
    nm: NM | None = None,
    vector: bool = True,
) -> torch.Tensor:
    """The compiled decode kernel on ``x`` (T, in) fp32 or bf16 (bits ≤ 4): equal to
    :func:`int4_reference.decode_linear` bit for bit. ``vector=False`` runs its plain loops
    (what a CPU without AVX-512 runs), for tests."""
    if bits > 4:
        raise ValueError(f"int4 decode kernel: {bits}-bit codes (3 or 4 only)")
    x, qweight, scales, zeros = _c(x), _c(qweight), _c(scales), _c(zeros)
    tokens, out_features = x.shape[0], scales.shape[0]
    width = in_features if group_size == -1 else group_size
    if nm is None:
        idx_ptr, idx_stride, n, m, idx_bits = None, 0, 1, 1, 0
    else:
        indices, n, m = nm
        indices = _c(indices)
        idx_ptr, idx_stride, idx_bits = indices.data_ptr(), indices.shape[1], _index_bits(m)
    kinds = cpu_kernels.FLOAT_KINDS
    if bias is None:
        bias_ptr, bias_kind = None, 0
    else:
        bias = _c(bias)
        bias_ptr, bias_kind = bias.data_ptr(), kinds[bias.dtype]
    y = torch.empty((tokens, out_features), dtype=x.dtype)
    cpu_kernels.library().lmc_int4_linear(
        x.data_ptr(), kinds[x.dtype], tokens, in_features, qweight.data_ptr(), qweight.shape[1],
        scales.data_ptr(), zeros.data_ptr(), in_features // width, width, idx_ptr, idx_stride, n,
        m, idx_bits, out_features, bias_ptr, bias_kind, y.data_ptr(), kinds[y.dtype],
        int(vector), torch.get_num_threads(),
    )  # fmt: skip
    return y


def _c(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def dequantize_rows(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    bits: int,
    group_size: int,
    in_features: int,
    start: int,
    end: int,
    dtype: torch.dtype,
    nm: NM | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows ``start:end`` of the weight (end - start, in) in ``dtype``: the compiled kernel for
    bits ≤ 4 and fp32 / bf16 on CPU (bit-identical; written into ``out``, a contiguous buffer of
    at least that many rows, where given), else :func:`int4_reference.dequantize_any` of those
    rows."""
    if (
        bits <= 4
        and dtype in KERNEL_DTYPES
        and qweight.device.type == "cpu"
        and not torch.compiler.is_compiling()
        and cpu_kernels.library() is not None
    ):
        qweight, scales, zeros = qweight.contiguous(), scales.contiguous(), zeros.contiguous()
        width, groups, indices, idx_stride, n, m, idx_bits = _layout(group_size, in_features, nm)
        if out is None:
            W = torch.empty((end - start, in_features), dtype=dtype)
        else:
            W = out[: end - start]
        cpu_kernels.library().lmc_int4_dequant(
            qweight.data_ptr(), qweight.shape[1], scales.data_ptr(), zeros.data_ptr(), groups,
            width, None if indices is None else indices.data_ptr(), idx_stride, n, m, idx_bits,
            start, end - start, in_features, W.data_ptr(), cpu_kernels.FLOAT_KINDS[dtype],
            torch.get_num_threads(),
        )  # fmt: skip
        return W
    rows = slice(start, end)
    part_nm = None if nm is None else (nm[0][rows], nm[1], nm[2])
    W = int4_reference.dequantize_any(
        qweight[rows], scales[rows], zeros[rows], bits, group_size, in_features, part_nm
    )
    return W.to(dtype)


_BUFFERS = threading.local()  # per thread: the last prefill block buffer of each dtype


def _buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A flat buffer of at least ``numel`` elements of ``dtype``, kept between calls (a fresh
    one of a few MiB costs its page faults on every call: ~10 % of a 512-token prefill)."""
    kept = getattr(_BUFFERS, "by_dtype", None)
    if kept is None:
        kept = _BUFFERS.by_dtype = {}
    buffer = kept.get(dtype)
    if buffer is None or buffer.numel() < numel:
        buffer = kept[dtype] = torch.empty(numel, dtype=dtype)
    return buffer[:numel]


def block_rows(in_features: int, dtype: torch.dtype) -> int:
    """Output rows per prefill block: ``BLOCK_BYTES`` of dequantized weight, at least
    ``MIN_BLOCK_ROWS``, a multiple of 16."""
    elem = torch.finfo(dtype).bits // 8
    return max(16, MIN_BLOCK_ROWS // 16 * 16, BLOCK_BYTES // (in_features * elem) // 16 * 16)


def prefill(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    bits: int,
    group_size: int,
    in_features: int,
    bias: torch.Tensor | None = None,
    nm: NM | None = None,
) -> torch.Tensor:
    """:func:`int4_reference.prefill_linear` with :func:`dequantize_rows`: (T, out) in ``x``'s
    dtype (float dtypes; other inputs are computed in float32)."""
    x, dtype, out_dtype, block, buffer = _prefill_setup(x, scales.shape[0], in_features)

    def rows(start: int, end: int) -> torch.Tensor:
        return dequantize_rows(
            qweight, scales, zeros, bits, group_size, in_features, start, end, dtype, nm, buffer
        )

    return int4_reference.prefill_linear(x, scales.shape[0], block, rows, bias, out_dtype)


def prefill_tiled(
    x: torch.Tensor,
    tiles: torch.Tensor,
    grid16: tuple[torch.Tensor, torch.Tensor],
    out_features: int,
    bits: int,
    group_size: int,
    in_features: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`prefill` of codes and grid in :mod:`~lmcompress.kernels.int4_tiles`' layout:
    ``lmc_int4_dequant_tiled`` reads them directly; where it does not apply, each block's rows
    are untiled first."""
    x, dtype, out_dtype, block, buffer = _prefill_setup(x, out_features, in_features)
    scales16, zeros16 = grid16
    stored: list[torch.Tensor] = []  # the row-major grid, made only where the kernel is not used

    def rows(start: int, end: int) -> torch.Tensor:
        if dtype in KERNEL_DTYPES and _eager_cpu(x) and cpu_kernels.library():
            W = buffer[: end - start]
            cpu_kernels.library().lmc_int4_dequant_tiled(
                tiles.data_ptr(), scales16.data_ptr(), zeros16.data_ptr(), scales16.shape[1],
                in_features // scales16.shape[1], start, end - start, in_features, W.data_ptr(),
                cpu_kernels.FLOAT_KINDS[dtype], torch.get_num_threads(),
            )  # fmt: skip
            return W
        if not stored:
            stored.extend(int4_tiles.untile_rows_of_grid(t, out_features) for t in grid16)
        codes = int4_tiles.untile_rows(tiles, in_features, start, end)
        part = slice(start, end)
        return dequantize_rows(
            codes, stored[0][part], stored[1][part], bits, group_size, in_features, 0,
            end - start, dtype, None, buffer,
        )  # fmt: skip

    return int4_reference.prefill_linear(x, out_features, block, rows, bias, out_dtype)


def prefill_tiled24(
    x: torch.Tensor,
    buffers: dict[str, torch.Tensor | None],
    out_features: int,
    bits: int,
    group_size: int,
    in_features: int,
) -> torch.Tensor:
    """:func:`prefill` of packed 2:4 codes in :mod:`~lmcompress.kernels.int4_tiles24`' layout
    (``buffers``: ``qweight`` its tiles, ``indices`` its patterns, ``scales16``, ``zeros16``,
    ``bias``): ``lmc_int4_dequant_tiled24`` reads them directly; where it does not apply
    (another dtype or device, tracing), each block's rows are untiled first."""
    x, dtype, out_dtype, block, buffer = _prefill_setup(x, out_features, in_features)
    stored: list[torch.Tensor] = []  # the row-major grid, made only where the kernel is not used

    def rows(start: int, end: int) -> torch.Tensor:
        if dtype in KERNEL_DTYPES and _eager_cpu(x) and cpu_kernels.library():
            out = None if buffer is None else buffer[: end - start]
            return int4_tiles24.dequantize_rows(buffers, in_features, start, end, dtype, out)
        if not stored:
            grid = (buffers["scales16"], buffers["zeros16"])
            stored.extend(int4_tiles.untile_rows_of_grid(t, out_features) for t in grid)
        qweight, indices = int4_tiles24.untile(buffers["qweight"], buffers["indices"], end)
        part = slice(start, end)
        return int4_reference.dequantize_any(
            qweight[part], stored[0][part], stored[1][part], bits, group_size, in_features,
            (indices[part], 2, 4),
        ).to(dtype)  # fmt: skip

    return int4_reference.prefill_linear(x, out_features, block, rows, buffers["bias"], out_dtype)


def _prefill_setup(x: torch.Tensor, out_features: int, in_features: int):
    """``x`` in its computing dtype (:func:`gemm_dtype.compute_dtype`: float32 for bf16 on a CPU
    that emulates bf16 matmuls), that dtype, the output's dtype (``x``'s; float32 for other
    inputs), the rows per block, and the block buffer (``None`` where autograd keeps each
    block's weight for the backward: a new one each)."""
    dtype = gemm_dtype.compute_dtype(x)
    out_dtype = x.dtype if x.dtype.is_floating_point else torch.float32
    x = x.to(dtype)
    block = block_rows(in_features, dtype)
    buffer = None
    if _eager_cpu(x):
        buffer = _buffer(min(block, out_features) * in_features, dtype).view(-1, in_features)
    return x, dtype, out_dtype, block, buffer
