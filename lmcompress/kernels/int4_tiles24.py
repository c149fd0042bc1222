"""The tiled in-memory layout of packed 2:4 int4 codes, and the decode kernel that reads it.

The stored ``nm_packed_int4`` layout (:mod:`lmcompress.kernels.int4_reference`) keeps each
row's kept codes and 2-bit positions together; its decode kernel gathers each row's kept
activations and sums each group's lanes, a horizontal sum per group and row: on a CPU with
AVX2 only it runs several times slower than dense int4 at one token, though it reads a quarter
fewer bytes; tiled, about as fast (``benchmarks/results/int4_speed_avx2``, both layouts: the
210 linears of SmolLM2 at one token 12.39 ms against int4's 13.31 and the stored layout's 33.43;
the per-group ``vpermd`` costs what the halved multiply-adds save; on an AVX-512 Xeon the
stored layout's AVX-512 loop is still twice as slow as the tiles' AVX2 one, :func:`hold`).

**Tiles** (``lmc_int4_linear_tiled24`` in ``cpu_kernels.cpp`` describes the loop): blocks of 16
rows; for each 16 input columns (4 groups of 4) and row, one int32 word of its 8 kept codes
(group ``i``'s first in bits ``4i .. 4i+3``, its second in bits ``16 + 4i ..``) and one int16
word of the 4 groups' *patterns* (``PAIRS``: which two of the four positions are kept, 0..5),
word ``k`` of the 16 rows consecutive: ``tiles`` (blocks, in / 16, 16) int32, ``patterns``
(blocks, in / 16, 16) int16. 3 bits a weight, as stored. Each token's activations become a
table of the 6 pairs of every group of 4; one ``vpermd`` picks every row's pair by its
pattern and one ``vpmaddwd`` adds both products: one multiply-add per group of 4 inputs where
dense int4 needs two, and no horizontal sum. The grid is held as :mod:`int4_tiles` holds it
(``scales16``, ``zeros16``: a group's 16 rows in one vector).
The integer group sums and the float steps are those of the row kernel: the outputs equal
:func:`int4_reference.decode_linear` bit for bit. Tiling rewrites whole codes (no rounding), so
:func:`untile` gives back the stored bytes exactly.

A :class:`~lmcompress.compressor.formats.int4.PackedNMInt4Linear` holds its codes so where
:func:`tileable` (2:4, bits ≤ 4, the input width and group multiples of 16, a group of at most
4096 columns so that its integer sums fit int32, on CPU, the kernels' vector loops built:
:func:`hold`) and in the stored layout otherwise; it writes the stored
layout. Prefill dequantizes straight from the tiles (``lmc_int4_dequant_tiled24``).
"""

from __future__ import annotations

import torch

from lmcompress.kernels import cpu_kernels, int4_reference, int4_tiles

# rows per tile (int4_tiles.ROWS: two AVX2 vectors of int32 lanes); up to int4_tiles.MAX_TOKENS
# tokens at decode, then prefill's dequantized blocks and the BLAS matmul
COLUMNS = 16  # columns per word
MAX_GROUP = 4096  # |D| < 2^31 in int32 lanes
PAIRS = ((0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3))  # pattern -> its kept positions


def hold() -> bool:
    """Whether layers hold their codes tiled on this host: wherever the int4 vector loops are
    built (``lmc_int4_vector()`` 1, AVX-512, or 2, AVX2; both CPUs run the AVX2 tile loop).
    Measured faster than the stored layout's loop on both: on an AVX2 EPYC (module doc), and on
    an AVX-512 Xeon with AMX (``python -m benchmarks.int4_speed``, 2 threads, median of 60
    rounds: SmolLM2's 210 linears at one token 7.29 ms tiled against 13.81 stored and 7.55 for
    dense int4; 8192 x 2048 at g128 382 us against 1172). Without them the stored layout's
    plain loop runs."""
    lib = cpu_kernels.library()
    return lib is not None and lib.lmc_int4_vector() in (1, 2)


def tileable(
    qweight: torch.Tensor, n: int, m: int, bits: int, group_size: int, in_features: int
) -> bool:
    """Whether packed codes ``qweight`` (the stored layout) are held tiled (module doc)."""
    width = int4_reference.group_width(group_size, in_features)
    return (
        (n, m) == (2, 4)
        and bits <= 4
        and in_features % COLUMNS == 0
        and width % COLUMNS == 0
        and width <= MAX_GROUP
        and qweight.device.type == "cpu"
        and hold()
    )


def _pattern_table() -> torch.Tensor:
    """(p0 * 4 + p1) -> pattern, -1 where the positions are not an ascending pair."""
    table = torch.full((16,), -1, dtype=torch.int16)
    for k, (a, b) in enumerate(PAIRS):
        table[4 * a + b] = k
    return table


def tile(
    qweight: torch.Tensor, indices: torch.Tensor, in_features: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The stored 2:4 codes ``qweight`` (out, in / 4) uint8 and positions ``indices``
    (out, in / 8) uint8 as (``tiles``, ``patterns``) (module doc); ``None`` where a group's
    positions are not an ascending pair (a layout ``pack_nm`` never writes)."""
    out, K = qweight.shape[0], in_features // COLUMNS
    nibbles = torch.stack((indices & 15, indices >> 4), dim=-1).reshape(out, -1).to(torch.int64)
    pattern = _pattern_table().to(indices.device)[(nibbles & 3) * 4 + (nibbles >> 2)]
    if bool((pattern < 0).any()):
        return None
    codes = qweight.reshape(out, K, 4)
    first, second = codes & 15, codes >> 4
    word = torch.stack(
        (first[..., 0] | first[..., 1] << 4, first[..., 2] | first[..., 3] << 4,
         second[..., 0] | second[..., 1] << 4, second[..., 2] | second[..., 3] << 4), dim=-1,
    )  # fmt: skip
    p = pattern.to(torch.uint8).reshape(out, K, 4)
    half = torch.stack((p[..., 0] | p[..., 1] << 4, p[..., 2] | p[..., 3] << 4), dim=-1)
    words = word.contiguous().view(torch.int32).squeeze(-1)  # (out, K)
    halves = half.contiguous().view(torch.int16).squeeze(-1)
    return int4_tiles.tile_rows(words), int4_tiles.tile_rows(halves)  # rows past out: zero


def untile(
    tiles: torch.Tensor, patterns: torch.Tensor, out: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`tile` undone: the stored (``qweight``, ``indices``)."""
    words = int4_tiles.untile_rows_of_grid(tiles, out)
    half = int4_tiles.untile_rows_of_grid(patterns, out)
    b = words.view(torch.uint8).reshape(out, -1, 4)
    first = torch.stack((b[..., 0] & 15, b[..., 0] >> 4, b[..., 1] & 15, b[..., 1] >> 4), -1)
    second = torch.stack((b[..., 2] & 15, b[..., 2] >> 4, b[..., 3] & 15, b[..., 3] >> 4), -1)
    qweight = (first | second << 4).reshape(out, -1)
    h = half.view(torch.uint8).reshape(out, -1, 2)
    pattern = torch.stack((h[..., 0] & 15, h[..., 0] >> 4, h[..., 1] & 15, h[..., 1] >> 4), -1)
    table = torch.tensor(PAIRS, dtype=torch.uint8, device=tiles.device)
    pairs = table[pattern.reshape(out, -1).long()]
    nibble = pairs[..., 0] | pairs[..., 1] << 2  # (out, in / 4)
    indices = nibble[:, 0::2] | nibble[:, 1::2] << 4
    return qweight.contiguous(), indices.contiguous()


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def decode(
    x: torch.Tensor,
    buffers: dict[str, torch.Tensor | None],
    in_features: int,
    out: int,
    vector: bool = True,
) -> torch.Tensor:
    """``lmc_int4_linear_tiled24`` on ``x`` (T, in) fp32 or bf16, contiguous: (T, out) in
    ``x``'s dtype, equal to :func:`int4_reference.decode_linear` bit for bit. ``buffers``: a
    tiled layer's ``qweight`` (tiles), ``indices`` (patterns), ``scales16``, ``zeros16``
    (:func:`int4_tiles.tile_grid`), ``bias`` (contiguous CPU tensors). ``vector=False`` runs
    the plain loop, for tests."""
    scales, bias = buffers["scales16"], buffers["bias"]
    groups = scales.shape[1]
    kind = int4_tiles.KINDS[x.dtype]
    bias_kind = 0 if bias is None else cpu_kernels.FLOAT_KINDS[bias.dtype]
    y = x.new_empty((*x.shape[:-1], out))
    cpu_kernels.library().lmc_int4_linear_tiled24(
        x.data_ptr(), kind, x.numel() // in_features, in_features, buffers["qweight"].data_ptr(),
        buffers["indices"].data_ptr(), scales.data_ptr(), buffers["zeros16"].data_ptr(), groups,
        in_features // groups, out, _ptr(bias), bias_kind,
        y.data_ptr(), kind, int(vector), torch.get_num_threads(),
    )  # fmt: skip
    return y


def dequantize_rows(
    buffers: dict[str, torch.Tensor | None], in_features: int, start: int, end: int,
    dtype: torch.dtype, out: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Rows ``start:end`` of the weight ``(q - z) · s`` in ``dtype`` (fp32 or bf16), as
    :func:`int4_reference.dequantize_any` (into ``out`` where given)."""
    scales = buffers["scales16"]
    W = torch.empty((end - start, in_features), dtype=dtype) if out is None else out
    cpu_kernels.library().lmc_int4_dequant_tiled24(
        buffers["qweight"].data_ptr(), buffers["indices"].data_ptr(), scales.data_ptr(),
        buffers["zeros16"].data_ptr(), scales.shape[1], in_features // scales.shape[1], start,
        end - start, in_features, W.data_ptr(), int4_tiles.KINDS[dtype], torch.get_num_threads(),
    )  # fmt: skip
    return W


def try_decode(
    x: torch.Tensor, buffers: dict[str, torch.Tensor | None], in_features: int, out: int
) -> torch.Tensor | None:
    """A tiled 2:4 layer's forward at decode, on the shortest path: the kernel on ``x``
    (..., in) with the layer's ``buffers`` (:func:`decode`), or ``None`` where it does not
    apply (:func:`int4_tiles.decode_applies`)."""
    if not int4_tiles.decode_applies(x, in_features):
        return None
    return decode(x if x.is_contiguous() else x.contiguous(), buffers, in_features, out)
