"""The tiled int4 layout and its decode kernel (``kernels/int4_tiles.py``,
``lmc_int4_linear_tiled`` in ``cpu_kernels.cpp``): the layout as specified (word by word), its
inverse, the kernel bit for bit equal to ``int4_reference.decode_linear`` at 1–16 tokens (odd
row counts, group widths 8 to 4096 and -1, 3 and 4 bits, both zero kinds, a bias, fp32 and bf16,
vector and plain loops), :func:`int4_ops.linear` on tiles equal to it on the stored codes at
decode and prefill, and where :class:`Int4Linear` holds its codes tiled."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import int4_weight as _weight
from conftest import requires_kernels

from lmcompress.compressor.formats.int4 import Int4Linear, PackedNMInt4Linear
from lmcompress.compressor.sparsity import nm_mask
from lmcompress.kernels import cpu_kernels, int4_ops, int4_tiles, int4_tiles24
from lmcompress.kernels import int4_reference as R4

pytestmark = requires_kernels

# (out, in, group_size): row counts below, between and above multiples of 16; one group of the
# whole row (-1); groups of 8 (one word), 32, 64, 96, 128 and 4096; more than 16 groups
SHAPES = [(37, 128, 32), (5, 96, 32), (16, 1056, 32), (9, 576, 64), (33, 2048, 64)]
SHAPES += [(13, 256, 128), (7, 104, -1), (5, 192, 96), (3, 64, 8), (2, 8192, 4096)]


def test_the_layout_is_words_of_16_rows():
    """Word k (8 codes, column 8k + i in bits 4i..4i+3) of row r is tiles[r // 16, k, r % 16];
    rows past the last are zero words; untile gives the stored bytes back."""
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (19, 24), dtype=torch.uint8, generator=g)
    qweight = R4.pack_codes(codes, 4)
    tiles = int4_tiles.tile(qweight)
    assert tiles.shape == (2, 3, 16) and tiles.dtype == torch.int32
    for r in range(19):
        for k in range(3):
            word = sum(int(codes[r, 8 * k + i]) << (4 * i) for i in range(8))
            assert int(tiles[r // 16, k, r % 16]) & 0xFFFFFFFF == word, (r, k)
    assert (tiles[1, :, 3:] == 0).all()
    assert torch.equal(int4_tiles.untile(tiles, 19), qweight)
    for start, end in [(0, 19), (3, 17), (16, 19), (5, 6)]:
        assert torch.equal(int4_tiles.untile_rows(tiles, 24, start, end), qweight[start:end])
    scales = torch.rand(19, 3)
    zeros = torch.randint(0, 16, (19, 3), dtype=torch.uint8)
    scales16, zeros16 = int4_tiles.tile_grid(scales, zeros)
    assert scales16.shape == zeros16.shape == (2, 3, 16) and zeros16.dtype == torch.uint8
    for r in range(19):
        assert torch.equal(scales16[r // 16, :, r % 16], scales[r]), r
        assert torch.equal(zeros16[r // 16, :, r % 16], zeros[r]), r


@pytest.mark.parametrize(("out", "in_features", "group_size"), SHAPES)
@pytest.mark.parametrize("bits", [3, 4])
def test_tiled_decode_is_the_reference_bit_for_bit(out, in_features, group_size, bits):
    g = torch.Generator().manual_seed(out * in_features + bits)
    for symmetric in (False, True) if bits == 4 else (False,):
        qweight, scales, zeros = _weight(out, in_features, bits, group_size, symmetric, seed=bits)
        tiles = int4_tiles.tile(qweight)
        bias = torch.randn(out, generator=g)
        for tokens in range(1, 17):
            for dtype in (torch.float32, torch.bfloat16):
                x = (torch.randn(tokens, in_features, generator=g) * 3).to(dtype)
                x[0, : in_features // 2] = 0  # a zero group takes the floor scale
                b = bias.to(dtype) if tokens % 2 else None
                want = R4.decode_linear(x, qweight, scales, zeros, bits, group_size, in_features, b)
                for vector in (True, False):
                    got = int4_tiles.decode(
                        x, tiles, scales, zeros, group_size, in_features, b, vector=vector
                    )
                    assert got.dtype == dtype and torch.equal(got, want), (tokens, dtype, vector)


def test_extreme_codes_and_activations_sum_exactly():
    """15 · 32767 over a group of 4096: the int32 limit of a group sum, split over the four
    accumulators and the zero-point term, gives the reference's integers."""
    qweight = R4.pack_codes(torch.full((17, 8192), 15, dtype=torch.uint8), 4)
    scales = torch.full((17, 2), 1e-6)
    for zero in (0, 15):
        zeros = torch.full((17, 2), zero, dtype=torch.uint8)
        x = torch.full((2, 8192), 7.0)
        x[1, 4096:] = -7.0
        want = R4.decode_linear(x, qweight, scales, zeros, 4, 4096, 8192)
        for vector in (True, False):
            tiles = int4_tiles.tile(qweight)
            got = int4_tiles.decode(x, tiles, scales, zeros, 4096, 8192, None, vector)
            assert torch.equal(got, want), (zero, vector)


@pytest.mark.parametrize(("out", "width", "group_size"), [(40, 64, 32), (37, 104, -1), (21, 48, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_on_tiles_is_linear_on_the_stored_codes(monkeypatch, out, width, group_size, dtype):
    """Up to the tiled MAX_TOKENS (any leading shape): the decode kernel's result (the
    reference's); more tokens: prefill, dequantized from the tiles by blocks (of 16 rows here,
    so several; groups the vector loop takes and ones only the plain loop takes), what prefill
    gives on the stored codes; and the same without the kernels (the tiles untiled)."""
    monkeypatch.setattr(int4_ops, "BLOCK_BYTES", 16 * width * 4)
    monkeypatch.setattr(int4_ops, "MIN_BLOCK_ROWS", 16)
    qweight, scales, zeros = _weight(out, width, 4, group_size)
    tiles = int4_tiles.tile(qweight)
    bias = torch.randn(out).to(dtype)
    kw = {"bits": 4, "group_size": group_size, "in_features": width, "bias": bias}
    most = int4_tiles.MAX_TOKENS
    for shape in [
        (1, width),
        (1, 1, width),
        (most, width),
        (2, most // 2, width),
        (most + 1, width),
    ]:
        x = torch.randn(shape).to(dtype)
        x2 = x.reshape(-1, width)
        if x2.shape[0] <= most:
            want = R4.decode_linear(x2, qweight, scales, zeros, 4, group_size, width, bias)
        else:
            want = int4_ops.prefill(x2, qweight, scales, zeros, 4, group_size, width, bias)
        got = int4_ops.linear(x, tiles, scales, zeros, tiled=True, **kw)
        assert got.shape == (*shape[:-1], out) and torch.equal(got, want.view(got.shape)), shape
    x = torch.randn(most + 3, width).to(dtype)
    want = int4_ops.linear(x, tiles, scales, zeros, tiled=True, **kw)
    monkeypatch.setattr(cpu_kernels, "library", lambda: None)
    plain = int4_ops.linear(x, tiles, scales, zeros, tiled=True, **kw)  # torch's dequantization
    torch.testing.assert_close(plain, want, rtol=0, atol=0)


def test_the_short_path_applies_only_to_decode():
    """``try_decode``: None for more than MAX_TOKENS tokens, fp16, a gradient to keep; else
    the kernel's output in the input's leading shape (a non-contiguous input copied)."""
    qweight, scales, zeros = _weight(24, 64, 4, 32)
    scales16, zeros16 = int4_tiles.tile_grid(scales, zeros)
    tiles = int4_tiles.tile(qweight)
    buffers = {"qweight": tiles, "scales16": scales16, "zeros16": zeros16, "bias": None}
    most = int4_tiles.MAX_TOKENS
    assert int4_tiles.try_decode(torch.randn(most + 1, 64), buffers, 64, 24) is None
    assert int4_tiles.try_decode(torch.randn(1, 64).half(), buffers, 64, 24) is None
    assert int4_tiles.try_decode(torch.randn(1, 64, requires_grad=True), buffers, 64, 24) is None
    assert int4_tiles.try_decode(torch.randn(1, 128), buffers, 64, 24) is None  # a wrong width
    x = torch.randn(most, 64)  # the most it takes
    want = R4.decode_linear(x, qweight, scales, zeros, 4, 32, 64)
    assert torch.equal(int4_tiles.try_decode(x, buffers, 64, 24), want)
    with pytest.raises(ValueError, match="64 features expected"):  # not read as two tokens
        int4_ops.linear(torch.randn(1, 128), tiles, scales, zeros, bits=4,
                        group_size=32, in_features=64, tiled=True)  # fmt: skip
    x = torch.randn(64, 3).t()  # (3, 64), not contiguous
    got = int4_tiles.try_decode(x[None], buffers, 64, 24)
    want = R4.decode_linear(x.contiguous(), qweight, scales, zeros, 4, 32, 64)
    assert got.shape == (1, 3, 24) and torch.equal(got[0], want)


def test_int4_linear_holds_tiles_where_the_kernel_reads_them(monkeypatch):
    """Tiled: 4 bits with widths multiple of 8; stored layout: 8 bits, an input width not a
    multiple of 8 (packed 2:4: int4_tiles24's tiles where held). Either way the same codes,
    grid, stored state, outputs and copies; a tiled layer holds its grid tiled only
    (``scales``/``zeros`` read untiled)."""
    linear = torch.nn.Linear(64, 40)
    tiled = Int4Linear.from_linear(linear, bits=4, group_size=32)
    assert tiled.tiled and tiled.qweight.dtype == torch.int32
    assert not Int4Linear.from_linear(linear, bits=8, group_size=32).tiled
    assert not Int4Linear.from_linear(torch.nn.Linear(36, 8), bits=4, group_size=-1).tiled
    sparse = torch.nn.Linear(64, 40)
    with torch.no_grad():
        sparse.weight *= nm_mask(sparse.weight.abs(), 2, 4)
    packed = PackedNMInt4Linear.from_linear(sparse, n=2, m=4, bits=4, group_size=32)
    assert packed.tiled == int4_tiles24.hold()  # its own tiles (test_int4_tiles24.py)
    stored = tiled.state_tensors()
    assert stored["qweight"].shape == (40, 32) and stored["qweight"].dtype == torch.uint8
    meta = {**tiled.meta(), "conv1d": False}
    again = Int4Linear.from_state(stored, meta)
    assert again.tiled and torch.equal(again.weight_codes(), tiled.weight_codes())
    with monkeypatch.context() as patch:  # the stored layout, as where the kernels are not built
        patch.setattr(int4_tiles, "tileable", lambda *_: False)
        plain = Int4Linear.from_state(stored, meta)
    assert not plain.tiled and plain.qweight.shape == (40, 32)
    assert set(tiled.state_dict()) == {"qweight", "scales16", "zeros16", "bias"}
    assert torch.equal(tiled.scales, plain.scales) and torch.equal(tiled.zeros, plain.zeros)
    with torch.inference_mode():
        for tokens in (1, 3, 40):
            x = torch.randn(2, tokens, 64)
            assert torch.equal(tiled(x), plain(x)), tokens
            assert torch.equal(copy.deepcopy(tiled)(x), plain(x)), tokens
    torch.testing.assert_close(tiled.dense_weight(), plain.dense_weight(), rtol=0, atol=0)


def test_a_module_built_on_meta_keeps_the_stored_layout_until_filled():
    """The Hugging Face quantizer builds modules on the meta device (transformers then fills
    the stored shapes), and tiles them afterwards with ``tile_codes``."""
    linear = torch.nn.Linear(64, 40)
    real = Int4Linear.from_linear(linear, bits=4, group_size=32)
    stored = {k: v.to("meta") for k, v in real.state_tensors().items()}
    meta = {**real.meta(), "conv1d": False}
    on_meta = Int4Linear.from_state(stored, meta)
    assert not on_meta.tiled and on_meta.qweight.shape == (40, 32)
    for key, tensor in real.state_tensors().items():  # as transformers' loader assigns them
        setattr(on_meta, key, tensor.clone())
    on_meta.tile_codes()
    x = torch.randn(1, 64)
    assert on_meta.tiled and torch.equal(on_meta(x), real(x))


def test_a_tiled_layers_grid_reads_and_writes_untiled_and_stays_float32():
    """``scales``/``zeros`` of a tiled layer: (out, groups) on reading, tiled on writing; a
    cast of the model to bf16 leaves the scales float32 (and the codes, zeros, uint8/int32)."""
    layer = Int4Linear.from_linear(torch.nn.Linear(64, 40), bits=4, group_size=32)
    assert layer.tiled and layer.scales.shape == (40, 2) and "scales" not in layer._buffers
    doubled = layer.scales * 2
    layer.scales = doubled
    assert torch.equal(layer.scales, doubled) and layer.scales16.shape == (3, 2, 16)
    x = torch.randn(3, 64)
    want = torch.nn.functional.linear(x, layer.dense_weight(), layer.bias)
    layer.to(torch.bfloat16)
    assert layer.scales16.dtype == torch.float32 and layer.zeros16.dtype == torch.uint8
    assert layer.bias.dtype == torch.bfloat16
    torch.testing.assert_close(layer(x.bfloat16()).float(), want, rtol=2e-2, atol=2e-2)
