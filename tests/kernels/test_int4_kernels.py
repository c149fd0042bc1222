"""The int4 runtime (``kernels/int4_ops.py``, ``lmc_int4_*`` in ``cpu_kernels.cpp``) against its
torch specification (``kernels/int4_reference.py``): the decode kernel bit for bit at 1–16
tokens on its vector and its plain loops (odd shapes, group sizes 32/64/128/-1 and the ones
only the plain loops read, 3 and 4 bits, asymmetric and symmetric zeros, a bias, fp32 and bf16
activations, packed N:M codes); the dequantization bit for bit; prefill by blocks equal to the
reference's blocks; which path :func:`int4_ops.linear` takes; and the decode error against the
float dequantized matmul."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import AVX2_ONLY, cpu_flags_or_skip, requires_kernels
from conftest import int4_weight as _weight

from lmcompress.compressor.sparsity import nm_mask
from lmcompress.kernels import cpu_kernels, gemm_dtype, int4_ops, int4_tiles
from lmcompress.kernels import int4_reference as R4
from lmcompress.kernels import reference as R

pytestmark = requires_kernels

# (out, in, group_size): odd outputs; inputs not a multiple of 64 (and odd, one group); more
# than 16 groups (two rounds of the 16-lane float part); group widths the fast loop does not
# take (-1 over 100 or 99 columns, 96, 8, the odd 33) and its largest one (4096)
SHAPES = [(37, 128, 32), (5, 96, 32), (7, 1056, 32), (9, 576, 64), (11, 2048, 64)]
SHAPES += [(13, 256, 128), (3, 640, 128), (7, 100, -1), (9, 99, -1), (5, 192, 96), (3, 64, 8)]
SHAPES += [(3, 66, 33), (3, 8192, 4096), (2, 8192, -1)]
TOKENS = list(range(1, 17))


def _nm_weight(out, in_features, bits, group_size, n, m, seed=0):
    """Kept codes packed two a byte over the kept axis, positions as ``pack_nm``'s."""
    g = torch.Generator().manual_seed(seed)
    mask = nm_mask(torch.rand(out, in_features, generator=g), n, m)
    q = torch.randint(0, 2**bits, (out, in_features), generator=g)
    values, indices = R.pack_nm(((q + 1) * mask).float(), n, m)
    kept = (values - 1).to(torch.uint8)
    _, scales, zeros = _weight(out, in_features, bits, group_size, seed=seed + 1)
    return R4.pack_codes(kept, bits), scales, zeros, (indices, n, m)


@pytest.mark.parametrize(("out", "in_features", "group_size"), SHAPES)
@pytest.mark.parametrize("bits", [3, 4])
def test_decode_is_the_reference_bit_for_bit(out, in_features, group_size, bits):
    """Every token count 1–16, fp32 and bf16, with and without a bias, asymmetric zeros (and
    symmetric at 4 bits), the vector loops and the plain loops of a CPU without AVX-512."""
    g = torch.Generator().manual_seed(out * in_features)
    for symmetric in (False, True) if bits == 4 else (False,):
        qweight, scales, zeros = _weight(out, in_features, bits, group_size, symmetric, seed=bits)
        bias = torch.randn(out, generator=g)
        for tokens in TOKENS:
            for dtype in (torch.float32, torch.bfloat16):
                x = (torch.randn(tokens, in_features, generator=g) * 3).to(dtype)
                x[0, : in_features // 2] = 0  # a zero group takes the floor scale
                b = bias.to(dtype) if tokens % 2 else None
                want = R4.decode_linear(x, qweight, scales, zeros, bits, group_size, in_features, b)
                for vector in (True, False):
                    got = int4_ops.decode(
                        x, qweight, scales, zeros, bits, group_size, in_features, b, vector=vector
                    )
                    assert got.dtype == dtype and torch.equal(got, want), (tokens, dtype, vector)


@pytest.mark.parametrize(
    ("out", "in_features", "group_size", "n", "m"),
    [(37, 128, 32, 2, 4), (5, 256, 64, 2, 4), (7, 200, -1, 2, 4), (9, 1152, 64, 2, 4)]
    + [(11, 512, 128, 2, 4), (6, 136, 8, 2, 4), (3, 96, 32, 1, 4), (5, 64, 16, 4, 8)],
)
def test_packed_nm_decode_and_dequantization_are_the_reference(out, in_features, group_size, n, m):
    qweight, scales, zeros, nm = _nm_weight(out, in_features, 4, group_size, n, m)
    W = R4.dequantize_any(qweight, scales, zeros, 4, group_size, in_features, nm)
    dense = R.unpack_nm(torch.ones(out, in_features // m * n), nm[0], n, m, in_features)
    assert torch.equal(W[dense == 0], torch.zeros(int((dense == 0).sum())))  # pruned: exactly 0
    g = torch.Generator().manual_seed(in_features)
    bias = torch.randn(out, generator=g)
    for tokens in (1, 2, 3, 4, 5, 9, 12, 16):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(tokens, in_features, generator=g).to(dtype)
            want = R4.decode_linear(x, qweight, scales, zeros, 4, group_size, in_features, bias, nm)
            for vector in (True, False):
                got = int4_ops.decode(
                    x, qweight, scales, zeros, 4, group_size, in_features, bias, nm, vector
                )
                assert torch.equal(got, want), (tokens, dtype, vector)
    for dtype in (torch.float32, torch.bfloat16):
        rows = int4_ops.dequantize_rows(
            qweight, scales, zeros, 4, group_size, in_features, 1, out, dtype, nm
        )
        assert torch.equal(rows, W[1:].to(dtype))


@pytest.mark.parametrize(("out", "in_features", "group_size"), SHAPES)
@pytest.mark.parametrize("bits", [3, 4, 8])
def test_dequantized_rows_are_the_reference_bit_for_bit(out, in_features, group_size, bits):
    qweight, scales, zeros = _weight(out, in_features, bits, group_size)
    W = R4.dequantize(qweight, scales, zeros, bits, group_size, in_features)
    assert torch.equal(W, R4.dequantize_any(qweight, scales, zeros, bits, group_size, in_features))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for start, end in ((0, out), (1, out), (out // 2, out // 2 + 1)):
            rows = int4_ops.dequantize_rows(
                qweight, scales, zeros, bits, group_size, in_features, start, end, dtype
            )
            assert rows.dtype == dtype and torch.equal(rows, W[start:end].to(dtype))


def test_extreme_codes_and_activations_sum_exactly():
    """15 · 32767 over a group of 4096 (2.0·10⁹, the fast loop's int32 limit) and over one
    group of 8192 (past int32: the plain path sums in int64): the reference's integers."""
    for group_size in (4096, -1):
        qweight = R4.pack_codes(torch.full((3, 8192), 15, dtype=torch.uint8), 4)
        groups = R4.groups_of(group_size, 8192)
        scales = torch.full((3, groups), 1e-6)
        zeros = torch.zeros(3, groups, dtype=torch.uint8)
        x = torch.full((2, 8192), 7.0)
        want = R4.decode_linear(x, qweight, scales, zeros, 4, group_size, 8192)
        for vector in (True, False):
            got = int4_ops.decode(x, qweight, scales, zeros, 4, group_size, 8192, vector=vector)
            assert torch.equal(got, want)
        torch.testing.assert_close(got, torch.full((2, 3), 15 * 7.0 * 8192 * 1e-6))


@pytest.mark.parametrize(
    ("dtype", "native"), [(torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False)]
)
def test_prefill_by_blocks_is_the_reference_by_blocks(monkeypatch, dtype, native):
    """Blocks of 16 rows (and a last partial block): the compiled dequantization of each block,
    then ``F.linear`` with its part of the bias, equals the torch dequantization's blocks bit for
    bit, and the float dequantized matmul to float rounding; bf16 on a CPU without a native bf16
    matmul (``native`` False): blocks of float32 rows, the product rounded to bf16."""
    monkeypatch.setattr(gemm_dtype, "native_bf16", lambda: native)
    compute = dtype if native else torch.float32
    monkeypatch.setattr(int4_ops, "BLOCK_BYTES", 16 * 96 * 4)
    monkeypatch.setattr(int4_ops, "MIN_BLOCK_ROWS", 16)
    qweight, scales, zeros = _weight(53, 96, 4, 32)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(40, 96, generator=g).to(dtype)
    bias = torch.randn(53, generator=g).to(dtype)
    W = R4.dequantize(qweight, scales, zeros, 4, 32, 96)
    got = int4_ops.linear(
        x, qweight, scales, zeros, bits=4, group_size=32, in_features=96, bias=bias
    )

    def torch_rows(start, end):
        return W[start:end].to(compute)

    assert int4_ops.block_rows(96, compute) == (16 if compute == torch.float32 else 32)
    block = int4_ops.block_rows(96, compute)
    want = R4.prefill_linear(x.to(compute), 53, block, torch_rows, bias).to(dtype)
    assert got.dtype == dtype and torch.equal(got, want)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(
        got.float(), F.linear(x.float(), W, bias.float()), rtol=tol, atol=tol
    )


def test_linear_takes_the_decode_kernel_only_where_it_applies(monkeypatch):
    """Up to ``MAX_TOKENS`` tokens (any leading shape), bits ≤ 4, fp32 / bf16: the kernel;
    more tokens, 8 bits, fp16, or no compiled library: prefill by blocks."""
    calls = []
    original = int4_ops.decode
    monkeypatch.setattr(int4_ops, "decode", lambda *a, **k: calls.append(1) or original(*a, **k))
    qweight, scales, zeros = _weight(24, 64, 4, 32)
    most = int4_ops.MAX_TOKENS
    kw = {"bits": 4, "group_size": 32, "in_features": 64}
    for shape, fused in [((most, 64), 1), ((1, most, 64), 1), ((2, 1, 64), 1), ((most + 1, 64), 0)]:
        calls.clear()
        x = torch.randn(shape)
        y = int4_ops.linear(x, qweight, scales, zeros, **kw)
        assert y.shape == (*shape[:-1], 24) and len(calls) == fused, shape
        if fused:
            want = R4.decode_linear(x.reshape(-1, 64), qweight, scales, zeros, 4, 32, 64)
            assert torch.equal(y, want.reshape(y.shape))
    calls.clear()
    int4_ops.linear(torch.randn(1, 64).half(), qweight, scales, zeros, **kw)
    q8, s8, z8 = _weight(24, 64, 8, 32)
    int4_ops.linear(torch.randn(1, 64), q8, s8, z8, bits=8, group_size=32, in_features=64)
    assert calls == []
    x = torch.randn(3, 64)
    decoded = int4_ops.linear(x, qweight, scales, zeros, **kw)
    monkeypatch.setattr(cpu_kernels, "library", lambda: None)
    plain = int4_ops.linear(x, qweight, scales, zeros, **kw)  # torch's dequantization, prefill
    assert calls == [1]
    W = R4.dequantize(qweight, scales, zeros, 4, 32, 64)
    assert torch.equal(plain, F.linear(x, W))
    assert float((decoded - plain).abs().max()) < 1e-4 * float(plain.abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_error_against_the_float_dequantized_matmul_is_bounded(dtype):
    """int16 activations: the decode output is within 1e-4 of the float dequantized matmul
    (relative to its largest value) in fp32, and within bf16's rounding in bf16, even with an
    outlier 100x the other activations in a group."""
    qweight, scales, zeros = _weight(64, 576, 4, 64, seed=5)
    W = R4.dequantize(qweight, scales, zeros, 4, 64, 576)
    g = torch.Generator().manual_seed(4)
    for tokens in (1, 5, 12):
        x = torch.randn(tokens, 576, generator=g)
        x[:, 7] = 100.0
        x = x.to(dtype)
        want = F.linear(x.float(), W)
        got = int4_ops.linear(x, qweight, scales, zeros, bits=4, group_size=64, in_features=576)
        err = float((got.float() - want).abs().max() / want.abs().max())
        assert err < (1e-4 if dtype == torch.float32 else 8e-3), err


def test_the_vector_loops_are_built_where_the_cpu_has_them():
    """A source that does not compile with ``-march=native`` falls back to plain flags (still
    bit for bit, but 3-10x slower): on a CPU with AVX-512 BW and VL its int4 loops are in, on
    one with AVX2 only (AMD Zen 2 and 3, Intel before Ice Lake) the AVX2 loops."""
    flags = cpu_flags_or_skip()
    if {"avx512bw", "avx512vl"} <= flags:
        assert cpu_kernels.library().lmc_int4_vector() == 1
    elif "avx2" in flags:
        assert cpu_kernels.library().lmc_int4_vector() == 2  # the AVX2 loops
    else:
        pytest.skip("neither AVX-512 BW/VL nor AVX2 here")


def test_the_avx512_loops_without_vnni_are_the_reference_too(kernels_built_with):
    """The library built without VNNI (as on an AVX-512 CPU that lacks it): the 16-bit
    products by ``vpmaddwd`` + add instead of ``vpdpwssd``, still bit for bit."""
    cpu_flags_or_skip("avx512bw", "avx512vl", "avx512_vbmi2")
    no_vnni = ["-O3", "-march=native", "-mno-avx512vnni", "-mno-avxvnni", "-fopenmp"]
    assert kernels_built_with(no_vnni, "this CPU without VNNI").lmc_int4_vector() == 1
    g = torch.Generator().manual_seed(8)
    for out, in_features, group_size in [(9, 576, 64), (7, 1056, 32), (5, 192, 96)]:
        qweight, scales, zeros = _weight(out, in_features, 4, group_size)
        x = torch.randn(5, in_features, generator=g)
        want = R4.decode_linear(x, qweight, scales, zeros, 4, group_size, in_features)
        got = int4_ops.decode(x, qweight, scales, zeros, 4, group_size, in_features)
        assert torch.equal(got, want)
        tiles = int4_tiles.tile(qweight)  # the tiled kernel's vpmaddwd too
        got = int4_tiles.decode(x, tiles, scales, zeros, group_size, in_features)
        assert torch.equal(got, want)
    qweight, scales, zeros, nm = _nm_weight(7, 512, 4, 128, 2, 4)
    x = torch.randn(3, 512, generator=g).bfloat16()
    want = R4.decode_linear(x, qweight, scales, zeros, 4, 128, 512, None, nm)
    assert torch.equal(int4_ops.decode(x, qweight, scales, zeros, 4, 128, 512, None, nm), want)


def test_the_avx2_loops_are_the_reference_too(kernels_built_with):
    """The library built without AVX-512 (as on a CPU with AVX2 only; on such a host the
    default build): the tiled decode, the packed 2:4 decode and the dequantization by their
    AVX2 loops, bit for bit, at 1-16 tokens, fp32 and bf16, every group width they take (32,
    64, 128, the whole row) and ones the dequantization or the 2:4 loop leave to the plain loop
    (8, 96; 2:4 over a row of 200 inputs)."""
    cpu_flags_or_skip("avx2")
    assert kernels_built_with(AVX2_ONLY, "this CPU without AVX-512").lmc_int4_vector() == 2
    g = torch.Generator().manual_seed(9)
    dense = [(37, 128, 32), (21, 1152, 64), (9, 2048, 128), (3, 64, 8), (5, 192, 96)]
    for out, in_features, group_size in dense:
        for bits, symmetric in [(4, True), (4, False), (3, False)]:
            qweight, scales, zeros = _weight(out, in_features, bits, group_size, symmetric)
            W = R4.dequantize(qweight, scales, zeros, bits, group_size, in_features)
            for dtype in (torch.float32, torch.bfloat16):
                rows = int4_ops.dequantize_rows(
                    qweight, scales, zeros, bits, group_size, in_features, 2, out, dtype
                )
                assert torch.equal(rows, W[2:].to(dtype)), (out, bits, dtype)
            tiles = int4_tiles.tile(qweight)
            for tokens in (1, 2, 3, 4, 5, 8, 16):
                x = (torch.randn(tokens, in_features, generator=g) * 3).to(
                    torch.bfloat16 if tokens % 2 else torch.float32
                )
                want = R4.decode_linear(x, qweight, scales, zeros, bits, group_size, in_features)
                got = int4_tiles.decode(x, tiles, scales, zeros, group_size, in_features)
                assert torch.equal(got, want), (out, bits, tokens)
    for out, in_features, group_size in [
        (37, 128, 32),
        (9, 1152, 64),
        (7, 512, -1),
        (7, 200, -1),
    ]:
        qweight, scales, zeros, nm = _nm_weight(out, in_features, 4, group_size, 2, 4)
        for tokens in (1, 3, 4, 6):
            x = torch.randn(tokens, in_features, generator=g).bfloat16()
            want = R4.decode_linear(x, qweight, scales, zeros, 4, group_size, in_features, None, nm)
            got = int4_ops.decode(x, qweight, scales, zeros, 4, group_size, in_features, None, nm)
            assert torch.equal(got, want), (out, in_features, tokens)


def test_gradients_through_prefill_blocks_are_the_dequantized_linear_s(monkeypatch):
    """A block's weight is saved for the backward: blocks are not written into one reused
    buffer when the input needs a gradient (they would all be the last block's)."""
    monkeypatch.setattr(int4_ops, "BLOCK_BYTES", 16 * 64 * 4)
    monkeypatch.setattr(int4_ops, "MIN_BLOCK_ROWS", 16)
    qweight, scales, zeros = _weight(40, 64, 4, 32)
    W = R4.dequantize(qweight, scales, zeros, 4, 32, 64)
    x = torch.randn(20, 64, requires_grad=True)
    kw = {"bits": 4, "group_size": 32, "in_features": 64}
    int4_ops.linear(x, qweight, scales, zeros, **kw).square().sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    F.linear(x2, W).square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-5)


def test_prefill_blocks_are_never_narrower_than_the_minimum():
    """Blocks of ``BLOCK_BYTES`` (4 MiB) where a row is narrow, at least ``MIN_BLOCK_ROWS``
    (1,024) where it is wide: an 8B-shaped 14336-wide layer's bf16 matmul ran twice as slow
    in blocks of 144 rows."""
    assert int4_ops.block_rows(576, torch.bfloat16) == (4 << 20) // (576 * 2) // 16 * 16 == 3632
    assert int4_ops.block_rows(14336, torch.bfloat16) == 1024
    assert int4_ops.block_rows(2048, torch.float32) == 1024
    assert int4_ops.block_rows(1536, torch.bfloat16) == 1360  # above the minimum: unchanged
