"""The compiled CPU kernels (``lmcompress/kernels/cpu_kernels.cpp``) against the reference:
packed N:M float matmuls to float32 rounding, int8 matmuls and unpacking bit for bit, for 2:4
(the AVX-512 loops and the scalar loop that finishes them) and every other N:M (scalar); the
fused int8 linear (dense and packed codes) bit for bit against the torch computation; the
low-rank kernel against two linears; the layers that call them; the build (cached, per
compiler and CPU) and its fallback."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from conftest import AVX2_ONLY, cpu_flags_or_skip, requires_kernels

from lmcompress.compressor.formats import quant
from lmcompress.compressor.formats.int8 import QuantLinear
from lmcompress.compressor.formats.low_rank import LowRankLinear
from lmcompress.compressor.formats.nm_packed import PackedNMLinear
from lmcompress.compressor.formats.nm_packed_int8 import PackedNMInt8Linear
from lmcompress.compressor.sparsity import nm_mask
from lmcompress.kernels import cpu_kernels, int8_ops, ops
from lmcompress.kernels import reference as R

pytestmark = requires_kernels

# (n, m, in): 2:4 with in features that end inside a 64-input (int8) and a 32-input (float)
# block, and layouts that only the scalar loop reads (positions of 1, 2, 4 and 8 bits).
LAYOUTS = [(2, 4, 200), (2, 4, 96), (2, 4, 8), (1, 4, 100), (3, 4, 100), (1, 2, 60), (2, 8, 96)]
LAYOUTS += [(4, 8, 96), (2, 6, 102), (3, 16, 96)]
TOKENS = [1, 2, 3, 4, 5, 9, cpu_kernels.MAX_TOKENS, cpu_kernels.MAX_TOKENS + 1]


def _sparse(out_features, in_features, n, m, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(out_features, in_features, generator=g)
    W = W * nm_mask(W.abs() + torch.rand(W.shape, generator=g), n, m)
    if dtype == torch.int8:
        return (W * 40).round().clamp(-127, 127).to(torch.int8)
    return W.to(dtype)


@pytest.mark.parametrize(("n", "m", "in_features"), LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
def test_unpack_is_the_reference_bit_for_bit(n, m, in_features, dtype):
    values, indices = R.pack_nm(_sparse(19, in_features, n, m, seed=1, dtype=dtype), n, m)
    want = R.unpack_nm(values, indices, n, m, in_features)
    got = ops.unpack_nm(values, indices, n, m, in_features)
    assert got.dtype == dtype and torch.equal(got, want)


@pytest.mark.parametrize(("n", "m", "in_features"), LAYOUTS)
@pytest.mark.parametrize("values_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_float_matmul_matches_the_reference(n, m, in_features, values_dtype):
    values, indices = R.pack_nm(_sparse(21, in_features, n, m, 2, values_dtype), n, m)
    W = R.unpack_nm(values, indices, n, m, in_features).double()
    g = torch.Generator().manual_seed(3)
    bias = torch.randn(21, generator=g)
    for tokens in TOKENS:
        x = torch.randn(tokens, in_features, generator=g)
        want = x.double() @ W.T + bias.double()
        got = cpu_kernels.matmul(x, values, indices, n, m, R.index_bits(m), bias)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
        got_bf16 = cpu_kernels.matmul(x.bfloat16(), values, indices, n, m, R.index_bits(m), None)
        want_bf16 = x.bfloat16().double() @ W.T  # the kernel widens bf16 inputs exactly
        assert got_bf16.dtype == torch.bfloat16
        torch.testing.assert_close(got_bf16.double(), want_bf16, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize(("n", "m", "in_features"), LAYOUTS)
def test_int8_matmul_is_int_mm_of_the_unpacked_codes(n, m, in_features):
    values, indices = R.pack_nm(_sparse(23, in_features, n, m, 4, torch.int8), n, m)
    codes = R.unpack_nm(values, indices, n, m, in_features)
    g = torch.Generator().manual_seed(5)
    for tokens in TOKENS:
        x_q = torch.randint(-128, 128, (tokens, in_features), dtype=torch.int8, generator=g)
        got = cpu_kernels.int8_matmul(x_q, values, indices, n, m, R.index_bits(m))
        assert got.dtype == torch.int32
        assert torch.equal(got, torch._int_mm(x_q, codes.t()))
        assert torch.equal(ops.nm_int8_matmul(x_q, values, indices, n, m, in_features), got)


@pytest.mark.parametrize("in_features", [8, 31, 576])
def test_dense_int8_products_are_int_mm_at_any_token_count(in_features, monkeypatch):
    """The kernel's products of dense codes, by blocks of 64 tokens (1, a block, one past it,
    several and a partial one), are ``_int_mm``'s; ``int8_ops.int8_matmul`` takes them where
    they beat ``_int_mm`` on the CPU (forced here both ways) with the same integers."""
    g = torch.Generator().manual_seed(in_features)
    w_q = torch.randint(-128, 128, (37, in_features), dtype=torch.int8, generator=g)
    kernel, calls = cpu_kernels.int8_matmul_dense, []
    monkeypatch.setattr(cpu_kernels, "int8_matmul_dense", lambda *a: calls.append(1) or kernel(*a))
    for tokens in (1, 5, 63, 64, 65, 130, 200):
        x_q = torch.randint(-128, 128, (tokens, in_features), dtype=torch.int8, generator=g)
        want = torch._int_mm(x_q, w_q.t())
        assert torch.equal(kernel(x_q, w_q), want), tokens
        for faster in (True, False):
            monkeypatch.setattr(cpu_kernels, "products_beat_int_mm", lambda f=faster: f)
            calls.clear()
            assert torch.equal(int8_ops.int8_matmul(x_q, w_q), want), (tokens, faster)
            assert len(calls) == faster, (tokens, faster)


def test_extreme_int8_codes_sum_exactly():
    """-128 · -128 over 2 · 576 kept inputs: 1.9·10⁷, past float32's exact integers (2²⁴)."""
    in_features = 2304
    codes = torch.full((3, in_features), -128, dtype=torch.int8)
    codes[:, 1::2] = 0
    values, indices = R.pack_nm(codes, 2, 4)
    x_q = torch.full((2, in_features), -128, dtype=torch.int8)
    got = cpu_kernels.int8_matmul(x_q, values, indices, 2, 4, 2)
    assert torch.equal(got, torch.full((2, 3), 128 * 128 * in_features // 2, dtype=torch.int32))


def _torch_int8(x, codes, weight_scale, input_scale, bias):
    """The int8 layers' computation in torch ops alone (no compiled kernel): activation codes,
    ``_int_mm``, the rescale (``int8_ops.rescale``'s ops)."""
    x_scale = quant.per_token_scale(x) if input_scale is None else input_scale
    y = torch.mul(torch._int_mm(quant.quantize(x, x_scale), codes.t()), x_scale)
    if bias is None:
        return y.mul_(weight_scale.t()).to(x.dtype)
    return torch.addcmul(bias.float(), y, weight_scale.t()).to(x.dtype)


@pytest.mark.parametrize("in_features", [8, 31, 64, 100, 576])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("static", [False, True])
def test_fused_int8_linear_is_the_torch_computation_bit_for_bit(in_features, dtype, static):
    """Dense codes, with and without a bias, per-token and static activation scales, fp32 and
    bf16 activations (a zero token takes the floor scale; a large static scale saturates)."""
    g = torch.Generator().manual_seed(in_features)
    codes = torch.randint(-128, 128, (37, in_features), dtype=torch.int8, generator=g)
    weight_scale = torch.rand(37, 1, generator=g) / 50 + 1e-4
    input_scale = torch.tensor([0.01]) if static else None
    for tokens in TOKENS:
        x = (torch.randn(tokens, in_features, generator=g) * 3).to(dtype)
        x[0] = 0
        for bias in (None, torch.randn(37, generator=g).to(dtype)):
            want = _torch_int8(x, codes, weight_scale, input_scale, bias)
            got = cpu_kernels.int8_linear(x, weight_scale, input_scale, bias, codes)
            assert got.dtype == dtype and torch.equal(got, want)


@pytest.mark.parametrize("in_features", [2048, 2056])
@pytest.mark.parametrize("out_features", [24, 22])
def test_one_token_over_long_rows_is_the_torch_computation_bit_for_bit(in_features, out_features):
    """One token over rows of 2048 inputs or more (an AVX2 build takes four rows a pass there),
    a row count that is a multiple of four or not, inputs that end inside a vector step; fp32
    and bf16, with and without a bias."""
    g = torch.Generator().manual_seed(in_features + out_features)
    codes = torch.randint(-128, 128, (out_features, in_features), dtype=torch.int8, generator=g)
    weight_scale = torch.rand(out_features, 1, generator=g) / 50 + 1e-4
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(1, in_features, generator=g) * 3).to(dtype)
        for bias in (None, torch.randn(out_features, generator=g).to(dtype)):
            want = _torch_int8(x, codes, weight_scale, None, bias)
            got = cpu_kernels.int8_linear(x, weight_scale, None, bias, codes)
            assert got.dtype == dtype and torch.equal(got, want)


@pytest.mark.parametrize("in_features", [8, 31, 100, 576])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_quantize_and_rescale_are_the_torch_computation_bit_for_bit(in_features, dtype):
    """The many-token halves around ``_int_mm``: codes and scales, per token and static (a
    zero token, saturation), and the rescale with and without a bias (fp32 and bf16)."""
    g = torch.Generator().manual_seed(in_features)
    for tokens in (1, 3, 40):
        x = (torch.randn(tokens, in_features, generator=g) * 3).to(dtype)
        x[0] = 0
        for input_scale in (None, torch.tensor([0.01])):
            want = quant.per_token_scale(x) if input_scale is None else input_scale
            codes, scale = cpu_kernels.int8_quantize(x, input_scale)
            assert torch.equal(codes, quant.quantize(x, want)) and torch.equal(scale, want)
        acc = torch.randint(-(2**22), 2**22, (tokens, 37), dtype=torch.int32, generator=g)
        weight_scale = torch.rand(37, 1, generator=g) / 50
        for bias in (None, torch.randn(37, generator=g).to(dtype)):
            y = torch.mul(acc, scale)
            if bias is None:
                want = y.mul_(weight_scale.t()).to(dtype)
            else:  # int8_ops.rescale's ops
                want = torch.addcmul(bias.float(), y, weight_scale.t()).to(dtype)
            got = cpu_kernels.int8_rescale(acc, scale, weight_scale, bias, dtype)
            assert got.dtype == dtype and torch.equal(got, want)


def test_int8_linear_by_column_blocks_is_the_torch_computation(monkeypatch):
    """Many tokens: ``_int_mm`` a block of output columns at a time, each rescaled into its
    columns of the output (blocks of 64 here, and a last partial one)."""
    monkeypatch.setattr(int8_ops, "BLOCK_BYTES", 4 * 40 * 64)
    g = torch.Generator().manual_seed(11)
    codes = torch.randint(-128, 128, (150, 96), dtype=torch.int8, generator=g)
    weight_scale = torch.rand(150, 1, generator=g) / 50
    x = torch.randn(40, 96, generator=g)
    x_q, x_scale = cpu_kernels.int8_quantize(x, None)
    for bias in (None, torch.randn(150, generator=g)):
        want = _torch_int8(x, codes, weight_scale, None, bias)
        got = int8_ops.linear(x_q, x_scale, codes, weight_scale, bias, torch.float32)
        assert torch.equal(got, want)


@pytest.mark.parametrize(("n", "m", "in_features"), LAYOUTS)
def test_fused_int8_linear_of_packed_codes_is_the_torch_computation(n, m, in_features):
    values, indices = R.pack_nm(_sparse(23, in_features, n, m, 8, torch.int8), n, m)
    codes = R.unpack_nm(values, indices, n, m, in_features)
    g = torch.Generator().manual_seed(9)
    weight_scale = torch.rand(23, 1, generator=g) / 50 + 1e-4
    bias = torch.randn(23, generator=g)
    for tokens in TOKENS:
        x = torch.randn(tokens, in_features, generator=g)
        want = _torch_int8(x, codes, weight_scale, None, bias)
        got = cpu_kernels.int8_linear(x, weight_scale, None, bias, values, indices, n, m)
        assert torch.equal(got, want)


@pytest.mark.parametrize(
    ("rank", "in_features", "out_features"), [(7, 100, 37), (48, 576, 192), (1, 16, 3), (5, 35, 9)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_rank_kernel_matches_two_linears(rank, in_features, out_features, dtype):
    """fp32 accumulation; the intermediate is rounded to ``dtype`` as two torch linears do."""
    g = torch.Generator().manual_seed(rank)
    A = (torch.randn(rank, in_features, generator=g) / in_features**0.5).to(dtype)
    B = (torch.randn(out_features, rank, generator=g) / rank**0.5).to(dtype)
    for tokens in range(1, cpu_kernels.LOW_RANK_MAX_TOKENS + 2):
        x = torch.randn(tokens, in_features, generator=g).to(dtype)
        for bias in (None, torch.randn(out_features, generator=g).to(dtype)):
            h = F.linear(x.double(), A.double()).to(dtype).double()
            want = F.linear(h, B.double(), None if bias is None else bias.double())
            got = cpu_kernels.lowrank(x, A, B, bias)
            assert got.dtype == dtype
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


def test_low_rank_kernel_rounds_the_intermediate_as_torch_does():
    """h = 1 + 2⁻⁹ is a tie in bf16 and rounds to 1, so h - 1 is 0 in torch's bf16 linears."""
    x = torch.tensor([[1.0, 2.0**-9]], dtype=torch.bfloat16)
    A, B = torch.ones(1, 2, dtype=torch.bfloat16), torch.ones(1, 1, dtype=torch.bfloat16)
    bias = torch.tensor([-1.0], dtype=torch.bfloat16)
    assert F.linear(F.linear(x, A), B, bias).item() == 0.0
    assert cpu_kernels.lowrank(x, A, B, bias).item() == 0.0
    assert cpu_kernels.lowrank(x.float(), A.float(), B.float(), bias.float()).item() == 2.0**-9


def test_layers_take_the_few_token_kernels_only_where_they_apply(monkeypatch):
    """Low rank and int8 layers call their kernels for few eager CPU tokens, and torch for
    more tokens, the simulated int8 path, and factors that need gradients."""
    calls = []
    for name in ("lowrank", "int8_linear"):
        original = getattr(cpu_kernels, name)
        monkeypatch.setattr(
            cpu_kernels, name, lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k)
        )
    torch.manual_seed(1)
    linear = torch.nn.Linear(64, 24)
    low_rank = LowRankLinear.from_linear(linear, 8)
    quant = QuantLinear.from_linear(linear)
    few, many = torch.randn(2, 1, 64), torch.randn(2, cpu_kernels.MAX_TOKENS, 64)
    with torch.no_grad():
        want = F.linear(F.linear(few, low_rank.A), low_rank.B, low_rank.bias)
        torch.testing.assert_close(low_rank(few), want, rtol=1e-5, atol=1e-6)
        assert torch.equal(
            quant(few),
            _torch_int8(
                few.reshape(2, 64), quant.weight_q, quant.weight_scale, None, quant.bias
            ).reshape(2, 1, 24),
        )
        assert calls == ["lowrank", "int8_linear"]
        low_rank(many), quant(many)
        quant.path = "simulated"
        quant(few)
    assert calls == ["lowrank", "int8_linear"]
    low_rank.A.requires_grad_(True)
    low_rank(few).sum().backward()
    assert calls == ["lowrank", "int8_linear"] and low_rank.A.grad is not None


def test_the_few_token_kernel_takes_exactly_up_to_max_tokens(monkeypatch):
    """The boundary: ``MAX_TOKENS`` tokens (in any leading shape) still take the fused int8
    kernel, one more does not."""
    calls = []
    original = cpu_kernels.int8_linear
    monkeypatch.setattr(cpu_kernels, "int8_linear", lambda *a: calls.append(1) or original(*a))
    quant = QuantLinear.from_linear(torch.nn.Linear(64, 24))
    most = cpu_kernels.MAX_TOKENS
    with torch.no_grad():
        for shape, fused in [((most, 64), 1), ((1, most, 64), 1), ((most + 1, 64), 0)]:
            calls.clear()
            quant(torch.randn(shape))
            assert len(calls) == fused, shape


def test_out_of_range_positions_are_skipped_not_read():
    """A 2:6 layout stores 4-bit positions: 0xF (never written by pack_nm) must not make the
    kernels read or write outside the row."""
    values, indices = R.pack_nm(_sparse(4, 12, 2, 6, 6), 2, 6)
    indices = torch.full_like(indices, 0xFF)
    x = torch.randn(1, 12)
    assert torch.equal(cpu_kernels.matmul(x, values, indices, 2, 6, 4), torch.zeros(1, 4))
    assert torch.equal(cpu_kernels.unpack(values, indices, 2, 6, 4, 12), torch.zeros(4, 12))


def test_packed_layers_call_the_kernels_and_agree_with_the_op():
    """Eager CPU forwards (direct calls) equal the op's (dispatch to the same CPU kernel), and
    2:4 + int8 equals its QuantLinear bit for bit, at decode and prefill token counts."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 40)
    with torch.no_grad():
        linear.weight.mul_(nm_mask(linear.weight.abs(), 2, 4))
    packed = PackedNMLinear.from_linear(linear, 2, 4)
    quant = QuantLinear.from_linear(linear)
    packed_int8 = PackedNMInt8Linear.from_quant(quant, 2, 4)
    for tokens in (1, 3, cpu_kernels.MAX_TOKENS + 5):
        x = torch.randn(2, tokens, 128)
        with torch.no_grad():
            op = torch.ops.lmcompress.nm_linear(
                x, packed.values, packed.indices, 2, 4, 128, packed.bias
            )
            assert torch.equal(packed(x), op)
            torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
            assert torch.equal(packed_int8(x), quant(x))


def test_the_avx2_loops_match_too(kernels_built_with):
    """The library built without AVX-512 (as on a CPU with AVX2 only, e.g. AMD Zen 2 and 3;
    on such a host the default build): 2:4 float rows (fp32, bf16, fp16 values) to float32
    rounding, dense float rows (the low-rank kernel), and dense and 2:4 int8 rows bit for bit,
    with inputs that end inside a vector step."""
    cpu_flags_or_skip("avx2", "fma", "f16c")
    assert kernels_built_with(AVX2_ONLY, "this CPU without AVX-512").lmc_nm_simd() == 2
    g = torch.Generator().manual_seed(6)
    for in_features in (200, 96, 8, 576):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            values, indices = R.pack_nm(_sparse(21, in_features, 2, 4, 2, dtype), 2, 4)
            W = R.unpack_nm(values, indices, 2, 4, in_features).double()
            for tokens in (1, 2, 3, 4, 5):
                x = torch.randn(tokens, in_features, generator=g)
                got = cpu_kernels.matmul(x, values, indices, 2, 4, 2)
                torch.testing.assert_close(got.double(), x.double() @ W.T, rtol=1e-5, atol=1e-4)
        values, indices = R.pack_nm(_sparse(23, in_features, 2, 4, 4, torch.int8), 2, 4)
        codes = R.unpack_nm(values, indices, 2, 4, in_features)
        for tokens in (1, 2, 3, 4, 5):
            x_q = torch.randint(-128, 128, (tokens, in_features), dtype=torch.int8, generator=g)
            want = torch._int_mm(x_q, codes.t())
            assert torch.equal(cpu_kernels.int8_matmul(x_q, values, indices, 2, 4, 2), want)
            weight_scale = torch.rand(23, 1, generator=g) / 50 + 1e-4
            x = torch.randn(tokens, in_features, generator=g)
            dense = cpu_kernels.int8_linear(x, weight_scale, None, None, codes)
            assert torch.equal(dense, _torch_int8(x, codes, weight_scale, None, None))
        A = torch.randn(7, in_features, generator=g) / in_features**0.5
        B = torch.randn(37, 7, generator=g)
        for tokens in (1, 2, 5):
            x = torch.randn(tokens, in_features, generator=g)
            want = F.linear(F.linear(x.double(), A.double()), B.double())
            got = cpu_kernels.lowrank(x, A, B, None)
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    for out_features in (24, 22):  # one token over long rows: four rows a pass
        codes = torch.randint(-128, 128, (out_features, 2056), dtype=torch.int8, generator=g)
        weight_scale = torch.rand(out_features, 1, generator=g) / 50 + 1e-4
        x = torch.randn(1, 2056, generator=g)
        want = _torch_int8(x, codes, weight_scale, None, None)
        assert torch.equal(cpu_kernels.int8_linear(x, weight_scale, None, None, codes), want)


def test_avx2_one_token_dense_rows_four_a_pass_are_the_row_loop_bit_for_bit(kernels_built_with):
    """One token over dense float rows (the low-rank factors): four rows a pass, the last
    ``out % 4`` by the row loop; each row's sum is the row loop's bit for bit (a one-row ``B``
    takes the row loop, the shared ``A`` the same path in both), for every float kind of weight
    and of activations, ranks that end inside a vector step or after an odd count of 8-blocks."""
    cpu_flags_or_skip("avx2", "fma", "f16c")
    assert kernels_built_with(AVX2_ONLY, "this CPU without AVX-512").lmc_nm_simd() == 2
    g = torch.Generator().manual_seed(8)
    for rank, out_features in ((77, 11), (72, 12), (576, 9), (8, 5), (3, 4)):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            A = (torch.randn(rank, 16, generator=g) / 4).to(dtype)
            B = torch.randn(out_features, rank, generator=g).to(dtype)
            bias = torch.randn(out_features, generator=g).to(dtype)
            for x_dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(1, 16, generator=g).to(x_dtype)
                got = cpu_kernels.lowrank(x, A, B, bias)
                rows = [cpu_kernels.lowrank(x, A, B[o : o + 1], bias[o : o + 1])
                        for o in range(out_features)]  # fmt: skip
                assert got.dtype == x_dtype and torch.equal(got, torch.cat(rows, dim=1))
                h = F.linear(x.double(), A.double()).to(x_dtype).double()  # rounded as torch's
                want = F.linear(h, B.double(), bias.double())
                tol = 1e-5 if x_dtype == torch.float32 else 2**-7
                torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


def test_the_build_is_cached_and_keyed_by_the_cpu(tmp_path, monkeypatch):
    """(A one-line source stands in for the kernels: the same build steps, in a second.)"""
    cache, source = tmp_path / "cache", tmp_path / "tiny.cpp"
    source.write_text('extern "C" int lmc_nm_simd() { return 0; }\n')
    monkeypatch.setattr(cpu_kernels, "SOURCE", source)
    monkeypatch.setenv("LMCOMPRESS_CACHE", str(cache))
    first = cpu_kernels._build()
    assert first.parent == cache / "kernels" and first.is_file()
    mtime = first.stat().st_mtime_ns
    assert cpu_kernels._build() == first and first.stat().st_mtime_ns == mtime  # not rebuilt
    monkeypatch.setattr(cpu_kernels, "_cpu_identity", lambda: "another CPU")
    assert cpu_kernels._build() != first  # code built for one CPU is never loaded on another
    assert sorted(p.suffix for p in (cache / "kernels").iterdir()) == [".so", ".so"]
    source.write_text('extern "C" int lmc_nm_simd() { return 1; }\n')
    assert cpu_kernels._build() != first  # a changed source is built anew


def test_no_compiler_falls_back_to_the_reference_with_one_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("LMCOMPRESS_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_kernels, "_compiler", lambda: "/bin/false")  # fails every build
    cpu_kernels.library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="lmcompress.kernels.cpu_kernels"):
            assert cpu_kernels.library() is None
            values, indices = R.pack_nm(_sparse(5, 16, 2, 4, 7), 2, 4)
            x = torch.randn(1, 16)
            want = R.nm_linear(x, values, indices, 2, 4, 16)
            assert torch.equal(ops.nm_linear_cpu(x, values, indices, 2, 4, 16), want)
        assert len(caplog.records) == 1 and "unpack on every call" in caplog.text
        assert list((tmp_path / "kernels").iterdir()) == []  # no half-written library left
    finally:
        cpu_kernels.library.cache_clear()


def test_disabled_by_the_environment(monkeypatch):
    monkeypatch.setenv("LMCOMPRESS_CPU_KERNELS", "0")
    cpu_kernels.library.cache_clear()
    try:
        assert cpu_kernels.library() is None
    finally:
        monkeypatch.delenv("LMCOMPRESS_CPU_KERNELS")
        cpu_kernels.library.cache_clear()
    assert cpu_kernels.library() is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_all_finite_finds_every_nan_and_infinity(dtype):
    big = torch.finfo(dtype).max
    values = torch.full((1000,), big, dtype=dtype)  # finite, though a float32 sum overflows
    assert cpu_kernels.all_finite(values)
    for bad in (float("nan"), float("inf"), float("-inf")):
        for at in (0, 517, 999):
            tampered = values.clone()
            tampered[at] = bad
            assert not cpu_kernels.all_finite(tampered), (bad, at)


def test_check_finite_counts_and_names_the_tensor_with_and_without_the_kernels(monkeypatch):
    from lmcompress.compressor.formats.base import check_finite
    from lmcompress.errors import ModelLoadError

    big = torch.full((64,), 3e38)  # its float32 sum overflows: the exact count decides
    check_finite("low_rank", {"A": big, "bias": None, "codes": torch.zeros(3, dtype=torch.int8)})
    tampered = big.clone()
    tampered[[3, 9]] = float("nan")
    for library in (cpu_kernels.library, lambda: None):
        monkeypatch.setattr(cpu_kernels, "library", library)
        check_finite("low_rank", {"A": big})
        with pytest.raises(ModelLoadError, match="low_rank tensor B holds 2 non-finite"):
            check_finite("low_rank", {"A": big, "B": tampered})


@pytest.mark.parametrize(("n", "m", "in_features"), LAYOUTS)
def test_position_checks_agree_with_and_without_the_kernel(n, m, in_features):
    """Valid layouts pass; a repeated or (where the bits allow it) out-of-range position is
    found at the same place by the torch lookup and by the compiled one."""
    _, indices = R.pack_nm(_sparse(9, in_features, n, m, 10), n, m)
    kept = in_features // m * n
    assert ops.bad_positions(indices, n, m, kept) is None
    assert R.bad_positions(indices, n, m, kept) is None
    codes = R._unpack_bits(indices, R.index_bits(m), kept).clone()
    group = min(2, kept // n - 1)
    if n > 1:
        codes[4, n * group + 1] = codes[4, n * group]  # a repeat in a group of row 4
    elif m < 2 ** R.index_bits(m):
        codes[4, group] = m
    else:
        return  # 1:2, 1:4: every code is a valid position
    tampered = R._pack_bits(codes, R.index_bits(m))
    found = ops.bad_positions(tampered, n, m, kept)
    assert found is not None and found.startswith("row 4")
    assert found == R.bad_positions(tampered, n, m, kept)
