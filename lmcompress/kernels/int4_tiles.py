"""The tiled in-memory layout of int4 codes, and the decode kernel that reads it.

The stored layout (:mod:`lmcompress.kernels.int4_reference`) keeps each output row's codes
together, two a byte: a decode kernel on it multiplies a row's codes with the activations in
vector lanes and then sums each group's lanes into one number, a horizontal sum per group and
row that costs as much as the products at SmolLM2's group of 64.

**Tiles** (``tiles16``): the same bytes read as 32-bit words (8 codes, column ``c + i`` in
bits ``4i .. 4i + 3``) and transposed by blocks of 16 rows, an int32 tensor (blocks, in / 8,
16): word ``k`` of rows ``16b .. 16b + 15`` are 16 consecutive words. One 64-byte load is then
8 columns of 16 rows, each row a vector lane, and ``lmc_int4_linear_tiled`` needs no horizontal
sum at all (``cpu_kernels.cpp`` describes the loop). Its results are those of the row kernel,
:func:`lmcompress.kernels.int4_ops.decode` and :func:`int4_reference.decode_linear`, bit for
bit: the same integer group sums and the same float steps in the same order.

The grid is tiled the same way (:func:`tile_grid`: a group's 16 scales in one vector, and its 16
zero points), so the kernel reads it with one load a group. Tiling is a transposition of whole
words (no code changes), so :func:`untile` gives back the stored bytes exactly. An
:class:`~lmcompress.compressor.formats.int4.Int4Linear` holds its codes and grid tiled where
:func:`tileable` (a CPU tensor, the compiled kernels loaded, bits ≤ 4, the input width and the
group a multiple of 8) and in the stored layout otherwise; it writes the stored layout. Prefill
dequantizes straight from the tiles (``lmc_int4_dequant_tiled``: a block of 16 rows untiled in a
per-thread buffer, then the stored layout's loops).

Speed (``python -m benchmarks.int4_speed`` → ``benchmarks/results/int4_speed.md``, 2 threads
of an Intel Xeon with AVX-512 VNNI): one pass over SmolLM2's 210 decoder linears at one token,
bf16, 7.35 ms tiled against 11.29 ms for the row kernel (17.77 ms dense fp32, 23.37 dense bf16);
its 1536x576 layer 43.6 µs against 77.1. The loads are prefetched 4 KiB ahead. A CPU with
AVX2 but not AVX-512 runs the same loop 8 rows a vector (each 64-byte tile line as two halves;
``benchmarks/results/int4_speed_avx2``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lmcompress.kernels import cpu_kernels, int4_reference

ROWS = 16  # rows per tile: one AVX-512 vector of int32 lanes
COLUMNS = 8  # columns per word
# The tiled decode kernel up to this many tokens, then prefill's path (dequantized blocks and
# the BLAS matmul): over SmolLM2's 210 decoder linears in bf16, 2 threads, 24.9 against 27.3 ms
# at 16 tokens, 33.6 against 29.0 at 24 (benchmarks/results/int4_speed.md, by token count).
MAX_TOKENS = 16


def tileable(qweight: torch.Tensor, bits: int, group_size: int, in_features: int) -> bool:
    """Whether codes ``qweight`` (the stored layout) are held tiled: on CPU (not meta), with
    the compiled kernels, at most 4 bits, the input width and the group width multiples of 8."""
    width = int4_reference.group_width(group_size, in_features)
    return (
        bits <= 4
        and in_features % COLUMNS == 0
        and width % COLUMNS == 0
        and qweight.device.type == "cpu"
        and cpu_kernels.library() is not None
    )


def tile(qweight: torch.Tensor) -> torch.Tensor:
    """The stored codes (out, in / 2) uint8 as tiles (ceil(out / 16), in / 8, 16) int32; rows
    past ``out`` are zero words."""
    out = qweight.shape[0]
    words = qweight.contiguous().view(torch.int32)  # (out, in / 8), little-endian
    blocks = -(-out // ROWS)
    padded = F.pad(words, (0, 0, 0, blocks * ROWS - out))
    return padded.reshape(blocks, ROWS, -1).transpose(1, 2).contiguous()


def tile_grid(scales: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The grid in the kernel's order: ``scales`` float32 and ``zeros`` uint8, each (out, groups)
    -> (ceil(out / 16), groups, 16): group ``g`` of rows ``16b .. 16b + 15`` in one vector
    (padding rows: scale 0, zero 0). A tiled Int4Linear holds its grid so (``scales16``,
    ``zeros16``) instead of row-major (its ``scales``, ``zeros`` then untile on reading)."""
    return tile_rows(scales.float()), tile_rows(zeros.to(torch.uint8))


def tile_rows(t: torch.Tensor) -> torch.Tensor:
    """One grid tensor (out, groups) in the kernel's order (ceil(out / 16), groups, 16)
    (padding rows zero)."""
    pad = -(-t.shape[0] // ROWS) * ROWS - t.shape[0]
    return F.pad(t, (0, 0, 0, pad)).reshape(-1, ROWS, t.shape[1]).transpose(1, 2).contiguous()


def untile_rows_of_grid(t16: torch.Tensor, out: int) -> torch.Tensor:
    """:func:`tile_rows` undone: (out, groups)."""
    return t16.transpose(1, 2).reshape(-1, t16.shape[1])[:out].contiguous()


def untile(tiles: torch.Tensor, out: int) -> torch.Tensor:
    """:func:`tile` undone: the stored codes (out, in / 2) uint8."""
    blocks, words, _ = tiles.shape
    rows = tiles.transpose(1, 2).reshape(blocks * ROWS, words)[:out]
    return rows.contiguous().view(torch.uint8)


def untile_rows(tiles: torch.Tensor, in_features: int, start: int, end: int) -> torch.Tensor:
    """Rows ``start:end`` of the stored codes (end - start, in / 2) uint8 (prefill's blocks)."""
    lib = cpu_kernels.library()
    if lib is None or tiles.device.type != "cpu":
        return untile(tiles, end)[start:]
    codes = torch.empty((end - start, in_features // 2), dtype=torch.uint8)
    lib.lmc_int4_untile_rows(
        tiles.data_ptr(), in_features, start, end - start, codes.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    return codes


def decode(
    x: torch.Tensor,
    tiles: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    in_features: int,
    bias: torch.Tensor | None = None,
    vector: bool = True,
    grid16: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``lmc_int4_linear_tiled`` on ``x`` (T, in) fp32 or bf16: (T, out) in ``x``'s dtype,
    equal to :func:`int4_reference.decode_linear` bit for bit. ``scales`` and ``zeros``
    (out, groups) as the format stores them, ``grid16`` their :func:`tile_grid` (computed here
    where not given); ``bias`` contiguous. ``vector=False`` runs the plain loop (what a CPU
    without AVX-512 runs), for tests."""
    width = in_features if group_size == -1 else group_size
    if scales.shape[1] * width != in_features:
        raise ValueError(f"int4 decode: {scales.shape[1]} groups of {width} for {in_features}")
    if grid16 is None:
        grid16 = tile_grid(scales, zeros)
    return decode_grid16(x, tiles, grid16, in_features, scales.shape[0], bias, vector)


def decode_grid16(
    x: torch.Tensor,
    tiles: torch.Tensor,
    grid16: tuple[torch.Tensor, torch.Tensor],
    in_features: int,
    out_features: int,
    bias: torch.Tensor | None = None,
    vector: bool = True,
) -> torch.Tensor:
    """:func:`decode` with the grid given only tiled (what a tiled layer holds)."""
    buffers = {"qweight": tiles, "scales16": grid16[0], "zeros16": grid16[1], "bias": bias}
    return _call(x.contiguous(), buffers, in_features, out_features, int(vector))


KINDS = {torch.float32: 0, torch.bfloat16: 1}  # the kernels' activations (FLOAT_KINDS')


def try_decode(
    x: torch.Tensor, buffers: dict[str, torch.Tensor | None], in_features: int, out: int
) -> torch.Tensor | None:
    """A tiled layer's forward at decode, on the shortest path (a decode step calls it for
    every linear): the kernel on ``x`` (..., in) with the layer's ``buffers`` (``qweight``
    tiled, ``scales16`` and ``zeros16`` from :func:`tile_grid`, ``bias``: contiguous CPU
    tensors), or ``None`` where it does not apply (more than :data:`MAX_TOKENS` tokens, another
    dtype, width or device, a gradient needed, tracing, no compiled kernels)."""
    if not decode_applies(x, in_features):
        return None
    return _call(x if x.is_contiguous() else x.contiguous(), buffers, in_features, out, 1)


def decode_applies(x: torch.Tensor, in_features: int) -> bool:
    """Whether a tiled decode kernel (this module's, :mod:`int4_tiles24`'s) runs on ``x``
    (..., in) eagerly: at most :data:`MAX_TOKENS` tokens of fp32 or bf16 on CPU, no gradient
    needed, not tracing, the kernels built."""
    return not (
        x.dtype not in KINDS
        or x.shape[-1] != in_features  # (the general path raises the error)
        or x.numel() > MAX_TOKENS * in_features
        or not x.is_cpu
        or (x.requires_grad and torch.is_grad_enabled())
        or torch.compiler.is_compiling()
        or cpu_kernels.library() is None
    )


def traced_decode_applies(x: torch.Tensor, in_features: int) -> bool:
    """While ``torch.compile`` traces (``x`` a fake tensor of the graph's fixed shape): whether
    :func:`try_decode` will run the kernel on ``x`` when the graph runs (what it checks that
    tracing knows)."""
    return (
        x.dtype in KINDS
        and x.shape[-1] == in_features
        and x.numel() <= MAX_TOKENS * in_features
        and x.device.type == "cpu"
        and cpu_kernels.built()
    )


def _call(x: torch.Tensor, buffers: dict, in_features: int, out: int, vector: int) -> torch.Tensor:
    scales16, bias = buffers["scales16"], buffers["bias"]
    groups = scales16.shape[1]
    kind = KINDS[x.dtype]
    y = x.new_empty((*x.shape[:-1], out))
    if bias is None:
        bias_ptr = bias_kind = 0
    else:
        bias_ptr, bias_kind = bias.data_ptr(), cpu_kernels.FLOAT_KINDS[bias.dtype]
    cpu_kernels.library().lmc_int4_linear_tiled(
        x.data_ptr(), kind, x.numel() // in_features, in_features, buffers["qweight"].data_ptr(),
        scales16.data_ptr(), buffers["zeros16"].data_ptr(), groups, in_features // groups, out,
        bias_ptr or None, bias_kind, y.data_ptr(), kind, vector, torch.get_num_threads(),
    )  # fmt: skip
    return y
