"""The tiled layout of packed 2:4 int4 codes (``kernels/int4_tiles24.py``,
``lmc_int4_*_tiled24`` in ``cpu_kernels.cpp``): the words' bits, tiling undone exactly, decode
bit for bit the reference at 1–16 tokens on the AVX2 loop and the plain one (odd row counts,
every group width it takes, 3 and 4 bits, symmetric and asymmetric zeros, a bias, fp32 and
bf16), the extreme sums, prefill's dequantization, and a tiled ``PackedNMInt4Linear`` equal to
one in the stored layout (outputs, state, copies, a module filled after construction)."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import cpu_flags_or_skip, int4_weight, requires_kernels

from lmcompress.compressor.formats.int4 import PackedNMInt4Linear
from lmcompress.compressor.sparsity import nm_mask
from lmcompress.kernels import int4_ops, int4_tiles, int4_tiles24
from lmcompress.kernels import int4_reference as R4
from lmcompress.kernels import reference as R

pytestmark = requires_kernels

# (out, in, group): rows not a multiple of 8 (a padded block), one row, the widest group
# (4096, int32's limit), a whole row as one group, two rounds of the 16 float partials
SHAPES = [(37, 128, 32), (1, 64, 16), (9, 1152, 64), (11, 512, 128), (5, 8192, 4096)]
SHAPES += [(6, 96, -1), (3, 2048, 64)]


def _packed(out, in_features, bits, group_size, symmetric=False, seed=0):
    """Random 2:4 kept codes (stored layout), positions, scales and zero points."""
    g = torch.Generator().manual_seed(seed)
    mask = nm_mask(torch.rand(out, in_features, generator=g), 2, 4)
    q = torch.randint(0, 2**bits, (out, in_features), generator=g)
    values, indices = R.pack_nm(((q + 1) * mask).float(), 2, 4)
    _, scales, zeros = int4_weight(out, in_features, bits, group_size, symmetric, seed + 1)
    return R4.pack_codes((values - 1).to(torch.uint8), bits), indices, scales, zeros


def _buffers(qweight, indices, scales, zeros, bias=None):
    tiles, patterns = int4_tiles24.tile(qweight, indices, indices.shape[1] * 8)
    scales16, zeros16 = int4_tiles.tile_grid(scales, zeros)
    grid = {"scales16": scales16, "zeros16": zeros16}
    return {"qweight": tiles, "indices": patterns, **grid, "bias": bias}


def test_the_words_hold_codes_and_patterns_where_the_kernel_reads_them():
    """One row of 16 inputs: group i's kept codes in bits 4i and 16 + 4i of the code word, its
    pattern (the index of its pair of positions in PAIRS) in bits 4i of the pattern word."""
    positions = [(0, 3), (1, 2), (2, 3), (0, 1)]
    codes = [(1, 2), (3, 4), (5, 6), (7, 15)]
    dense = torch.zeros(1, 16)
    for i, ((a, b), (ca, cb)) in enumerate(zip(positions, codes, strict=True)):
        dense[0, 4 * i + a], dense[0, 4 * i + b] = ca + 1, cb + 1
    values, indices = R.pack_nm(dense, 2, 4)
    qweight = R4.pack_codes((values - 1).to(torch.uint8), 4)
    tiles, patterns = int4_tiles24.tile(qweight, indices, 16)
    assert tiles.shape == (1, 1, 16) and patterns.shape == (1, 1, 16)
    word = sum(ca << (4 * i) | cb << (16 + 4 * i) for i, (ca, cb) in enumerate(codes))
    pattern = sum(int4_tiles24.PAIRS.index(p) << (4 * i) for i, p in enumerate(positions))
    assert int(tiles[0, 0, 0]) & 0xFFFFFFFF == word and int(patterns[0, 0, 0]) == pattern
    assert not tiles[0, 0, 1:].any() and not patterns[0, 0, 1:].any()  # padding rows: zero


def test_tiling_is_undone_exactly_and_refuses_what_pack_nm_never_writes():
    qweight, indices, _, _ = _packed(19, 256, 4, 64)
    tiles, patterns = int4_tiles24.tile(qweight, indices, 256)
    assert tiles.shape == (2, 16, 16) and tiles.dtype == torch.int32
    back = int4_tiles24.untile(tiles, patterns, 19)
    assert torch.equal(back[0], qweight) and torch.equal(back[1], indices)
    for bad in (0b0101, 0b0111):  # positions (1, 1), then (3, 1): not an ascending pair
        tampered = indices.clone()
        tampered[5, 3] = bad | (tampered[5, 3] & 0xF0)
        assert int4_tiles24.tile(qweight, tampered, 256) is None


@pytest.mark.parametrize(("out", "in_features", "group_size"), SHAPES)
@pytest.mark.parametrize("bits", [3, 4])
def test_tiled_decode_is_the_reference_bit_for_bit(out, in_features, group_size, bits):
    g = torch.Generator().manual_seed(out + in_features)
    for symmetric in (False, True) if bits == 4 else (False,):
        qweight, indices, scales, zeros = _packed(out, in_features, bits, group_size, symmetric)
        nm = (indices, 2, 4)
        bias = torch.randn(out, generator=g)
        for tokens in range(1, 17):
            dtype = (torch.float32, torch.bfloat16)[tokens % 2]
            x = (torch.randn(tokens, in_features, generator=g) * 3).to(dtype)
            x[0, : in_features // 2] = 0  # a zero group takes the floor scale
            b = bias.to(dtype) if tokens % 3 else None
            want = R4.decode_linear(x, qweight, scales, zeros, bits, group_size, in_features, b, nm)
            buffers = _buffers(qweight, indices, scales, zeros, b)
            for vector in (True, False):
                got = int4_tiles24.decode(x, buffers, in_features, out, vector)
                assert got.dtype == dtype and torch.equal(got, want), (tokens, symmetric, vector)


def test_extreme_codes_and_activations_sum_exactly():
    """(15 - 0) · 32767 over the 2048 kept codes of a group of 4096 (1.0·10⁹ in an int32
    lane), and (0 - 15) · -32768: the reference's integers."""
    out, width = 8, 4096
    dense = torch.zeros(out, width)
    dense[:, 0::2] = 16  # code 15 kept at positions 0 and 2 of every group of 4
    dense[4:] = dense[4:] / 16  # code 0 in the last 4 rows
    values, indices = R.pack_nm(dense, 2, 4)
    qweight = R4.pack_codes((values - 1).to(torch.uint8), 4)
    zeros = torch.tensor([[0]] * 4 + [[15]] * 4, dtype=torch.uint8)
    scales = torch.full((out, 1), 1e-3)
    buffers = _buffers(qweight, indices, scales, zeros)
    for sign in (1.0, -1.0):
        x = torch.full((2, width), sign)
        x[1, 1::2] = -sign  # the pruned positions: no part of the sum
        want = R4.decode_linear(x, qweight, scales, zeros, 4, -1, width, None, (indices, 2, 4))
        for vector in (True, False):
            got = int4_tiles24.decode(x, buffers, width, out, vector)
            assert torch.equal(got, want), (sign, vector)


@pytest.mark.parametrize(("out", "in_features", "group_size"), SHAPES[:4])
def test_dequantized_rows_are_the_reference_bit_for_bit(out, in_features, group_size):
    qweight, indices, scales, zeros = _packed(out, in_features, 4, group_size)
    W = R4.dequantize_any(qweight, scales, zeros, 4, group_size, in_features, (indices, 2, 4))
    buffers = _buffers(qweight, indices, scales, zeros)
    for dtype in (torch.float32, torch.bfloat16):
        for start, end in ((0, out), (out // 2, out)):
            rows = int4_tiles24.dequantize_rows(buffers, in_features, start, end, dtype)
            assert torch.equal(rows, W[start:end].to(dtype)), (dtype, start)


def test_tiles_are_held_on_every_cpu_with_avx2():
    """The tiles' loop is AVX2 code, which AVX-512 CPUs run as well, and it beat the stored
    layout's loop on both kinds (``hold``'s docstring): a CPU with AVX2, AVX-512 or not, holds
    packed 2:4 int4 codes tiled (they were held only without AVX-512 before, at half the
    speed there)."""
    cpu_flags_or_skip("avx2", "fma", "f16c")
    assert int4_tiles24.hold()
    q = torch.zeros(8, 64, dtype=torch.uint8)
    assert int4_tiles24.tileable(q, 2, 4, 4, 32, 256)


def test_what_is_held_tiled():
    """2:4 only, bits ≤ 4, widths and groups multiples of 16, groups up to 4096, on CPU."""
    q = torch.zeros(8, 64, dtype=torch.uint8)
    held = int4_tiles24.hold()
    assert int4_tiles24.tileable(q, 2, 4, 4, 32, 256) == held
    assert int4_tiles24.tileable(q, 2, 4, 3, -1, 4096) == held
    assert not int4_tiles24.tileable(q, 1, 4, 4, 32, 256)
    assert not int4_tiles24.tileable(q, 4, 8, 4, 32, 256)
    assert not int4_tiles24.tileable(q, 2, 4, 8, 32, 256)
    assert not int4_tiles24.tileable(q, 2, 4, 4, 8, 256)  # a group of 8
    assert not int4_tiles24.tileable(q, 2, 4, 4, -1, 200)  # 200 inputs
    assert not int4_tiles24.tileable(q, 2, 4, 4, -1, 8192)  # a group past int32's sums
    assert not int4_tiles24.tileable(q.to("meta"), 2, 4, 4, 32, 256)


def _sparse_linear(out, in_features, seed=0):
    linear = torch.nn.Linear(in_features, out)
    with torch.no_grad():
        linear.weight.copy_(
            torch.randn(out, in_features, generator=torch.Generator().manual_seed(seed))
        )
        linear.weight *= nm_mask(linear.weight.abs(), 2, 4)
    return linear


def test_a_tiled_layer_is_the_stored_layers_twin(monkeypatch):
    """Tiled (where held) and stored: the same outputs at decode and prefill (fp32, bf16, the
    torch fallback of a traced graph), codes, stored state and copies; state reloads tiled."""
    linear = _sparse_linear(40, 96)
    with monkeypatch.context() as patch:
        patch.setattr(int4_tiles24, "hold", lambda: True)
        tiled = PackedNMInt4Linear.from_linear(linear, n=2, m=4, bits=4, group_size=32)
        again = PackedNMInt4Linear.from_state(
            tiled.state_tensors(), {**tiled.meta(), "conv1d": False}
        )
    with monkeypatch.context() as patch:
        patch.setattr(int4_tiles24, "hold", lambda: False)
        plain = PackedNMInt4Linear.from_linear(linear, n=2, m=4, bits=4, group_size=32)
    assert tiled.tiled and again.tiled and not plain.tiled
    assert tiled.qweight.shape == (3, 6, 16) and tiled.indices.dtype == torch.int16
    assert set(tiled.state_dict()) == {"qweight", "indices", "scales16", "zeros16", "bias"}
    for key, value in plain.state_tensors().items():
        assert torch.equal(tiled.state_tensors()[key], value), key
    assert torch.equal(tiled.weight_codes(), plain.weight_codes())
    nm = (plain.indices, 2, 4)
    with torch.inference_mode():  # the stored layout decodes up to 6 tokens, tiles up to 16
        for tokens in (1, 6, 12, 40):
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(tokens, 96).to(dtype)
                stored = copy.deepcopy(plain).to(dtype)  # (.to casts the bias in place)
                want = stored(x)
                if tokens == 12:
                    grid = stored.scales, stored.zeros
                    want = R4.decode_linear(x, stored.qweight, *grid, 4, 32, 96, stored.bias, nm)
                got = copy.deepcopy(tiled).to(dtype)(x[None])[0]
                assert torch.equal(got, want), (tokens, dtype)
                assert torch.equal(copy.deepcopy(again).to(dtype)(x), want), (tokens, dtype)
    x = torch.randn(3, 96)
    buffers = {k: tiled._buffers[k] for k in ("qweight", "indices", "scales16", "zeros16", "bias")}
    with monkeypatch.context() as patch:  # a traced graph's fallback: untiled, then torch
        patch.setattr(int4_ops, "_eager_cpu", lambda _: False)
        fallback = int4_ops.prefill_tiled24(x, buffers, 40, 4, 32, 96)
    dense = torch.nn.functional.linear(x, plain.dequantized(), plain.bias)
    torch.testing.assert_close(fallback, dense, rtol=1e-5, atol=1e-5)


def test_a_module_built_on_meta_tiles_once_filled(monkeypatch):
    monkeypatch.setattr(int4_tiles24, "hold", lambda: True)
    real = PackedNMInt4Linear.from_linear(_sparse_linear(16, 64), n=2, m=4, bits=4, group_size=64)
    stored = {k: v.to("meta") for k, v in real.state_tensors().items()}
    on_meta = PackedNMInt4Linear.from_state(stored, {**real.meta(), "conv1d": False})
    assert not on_meta.tiled
    for key, tensor in real.state_tensors().items():  # as transformers' loader assigns them
        setattr(on_meta, key, tensor.clone())
    on_meta.tile_codes()
    x = torch.randn(1, 64)
    assert on_meta.tiled and torch.equal(on_meta(x), real(x))
