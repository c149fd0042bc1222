"""The dtype bf16 prefill matmuls run in (``kernels/gemm_dtype.py``): float32 on an x86 CPU
without AVX-512 BF16 or AMX-BF16, bf16 elsewhere, chosen from the flags or the override; and the
int4 prefill paths (stored codes, tiled, tiled 2:4) computing in it with a bf16 output."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import int4_weight, linear_dtypes

from lmcompress.compressor.sparsity import nm_mask
from lmcompress.kernels import gemm_dtype, int4_ops, int4_tiles, int4_tiles24, ops
from lmcompress.kernels import int4_reference as R4
from lmcompress.kernels import reference as R

ZEN3 = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx avx2 fma f16c\n"
SAPPHIRE = "flags\t\t: avx2 avx512f avx512_vnni avx512_bf16 amx_bf16 amx_int8\n"
COOPER = "flags\t\t: avx2 avx512f avx512_bf16\n"
AMX_ONLY = "flags\t\t: avx2 amx_bf16\n"


@pytest.mark.parametrize(
    ("machine", "cpuinfo", "override", "native"),
    [
        ("x86_64", ZEN3, None, False),
        ("x86_64", SAPPHIRE, None, True),
        ("x86_64", COOPER, None, True),  # either flag is enough
        ("x86_64", AMX_ONLY, None, True),
        ("x86_64", ZEN3.replace("avx2", "avx512_bf16x"), None, False),  # a whole flag only
        ("aarch64", ZEN3, None, True),  # not x86: torch's bf16 matmul left alone
        ("x86_64", None, None, True),  # cpuinfo unreadable
        ("x86_64", "processor\t: 0\n", None, True),  # no flags line
        ("x86_64", ZEN3, "native", True),
        ("x86_64", SAPPHIRE, "float32", False),
    ],
)
def test_native_bf16_from_the_flags_or_the_override(machine, cpuinfo, override, native):
    assert gemm_dtype.native_bf16_from(machine, cpuinfo, override) is native


def test_an_unknown_override_is_refused():
    with pytest.raises(ValueError, match="LMCOMPRESS_BF16_GEMM='bf16'"):
        gemm_dtype.native_bf16_from("x86_64", ZEN3, "bf16")


@pytest.mark.parametrize("native", [True, False])
def test_compute_dtype(monkeypatch, native):
    monkeypatch.setattr(gemm_dtype, "native_bf16", lambda: native)
    compute = gemm_dtype.compute_dtype
    assert compute(torch.zeros(2, dtype=torch.bfloat16)) == (
        torch.bfloat16 if native else torch.float32
    )
    assert compute(torch.zeros(2, dtype=torch.float32)) == torch.float32
    assert compute(torch.zeros(2, dtype=torch.float16)) == torch.float16
    assert compute(torch.zeros(2, dtype=torch.int64)) == torch.float32
    assert compute(torch.zeros(2, dtype=torch.bfloat16, device="meta")) == torch.bfloat16


def _packed24(out, in_features, group_size):
    g = torch.Generator().manual_seed(3)
    mask = nm_mask(torch.rand(out, in_features, generator=g), 2, 4)
    q = torch.randint(0, 16, (out, in_features), generator=g)
    values, indices = R.pack_nm(((q + 1) * mask).float(), 2, 4)
    _, scales, zeros = int4_weight(out, in_features, 4, group_size, seed=4)
    return R4.pack_codes((values - 1).to(torch.uint8), 4), indices, scales, zeros


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("layout", ["stored", "stored 2:4", "tiled", "tiled 2:4"])
def test_int4_prefill_computes_in_the_gemm_dtype(monkeypatch, native, layout):
    """bf16 activations, 20 tokens (prefill), blocks of 16 rows: the output is bf16 and equals
    the dequantized weight times the activations in the compute dtype (bf16, or float32 with the
    product rounded to bf16 once), bias included."""
    monkeypatch.setattr(gemm_dtype, "native_bf16", lambda: native)
    monkeypatch.setattr(int4_ops, "MIN_BLOCK_ROWS", 16)
    monkeypatch.setattr(int4_ops, "BLOCK_BYTES", 16 * 64 * 4)
    out, width, group = 40, 64, 32
    g = torch.Generator().manual_seed(5)
    x = torch.randn(20, width, generator=g).bfloat16()
    bias = torch.randn(out, generator=g).bfloat16()
    kw = {"bits": 4, "group_size": group, "in_features": width, "bias": bias}
    if layout.endswith("2:4"):
        qweight, indices, scales, zeros = _packed24(out, width, group)
        nm = (indices, 2, 4)
    else:
        (qweight, scales, zeros), nm = int4_weight(out, width, 4, group, seed=6), None
    W = R4.dequantize_any(qweight, scales, zeros, 4, group, width, nm)
    if layout == "tiled":
        got = int4_ops.linear(x, int4_tiles.tile(qweight), scales, zeros, tiled=True, **kw)
    elif layout == "tiled 2:4":
        tiles, patterns = int4_tiles24.tile(qweight, indices, width)
        scales16, zeros16 = int4_tiles.tile_grid(scales, zeros)
        buffers = {"qweight": tiles, "indices": patterns, "scales16": scales16}
        buffers |= {"zeros16": zeros16, "bias": bias}
        got = int4_ops.prefill_tiled24(x, buffers, out, 4, group, width)
    else:
        got = int4_ops.linear(x, qweight, scales, zeros, nm=nm, **kw)
    compute = torch.bfloat16 if native else torch.float32
    parts = [
        torch.nn.functional.linear(
            x.to(compute), W[s : s + 16].to(compute), bias[s : s + 16].to(compute)
        )
        for s in range(0, out, 16)
    ]
    want = torch.cat(parts, dim=1).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


@pytest.mark.parametrize("native", [True, False])
def test_packed_nm_and_low_rank_prefill_compute_in_the_gemm_dtype(monkeypatch, native):
    """Past their few-token kernels (20 tokens), the packed 2:4 layer (unpacked, then one matmul)
    and the low-rank one (two matmuls, the rank-sized middle not rounded to bf16 in float32)
    compute in the compute dtype and return bf16."""
    monkeypatch.setattr(gemm_dtype, "native_bf16", lambda: native)
    compute = torch.bfloat16 if native else torch.float32
    seen = linear_dtypes(monkeypatch)  # a bf16 weight: the values alone may not tell
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 10, 64, generator=g).bfloat16()
    bias = torch.randn(24, generator=g).bfloat16()
    dense = torch.randn(24, 64, generator=g) * nm_mask(torch.rand(24, 64, generator=g), 2, 4)
    values, indices = R.pack_nm(dense.bfloat16(), 2, 4)
    got = ops.nm_linear_cpu(x, values, indices, 2, 4, 64, bias)
    assert seen == [{compute}]
    W = dense.bfloat16().to(compute)
    want = F.linear(x.to(compute), W, bias.to(compute)).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    seen.clear()
    A = torch.randn(8, 64, generator=g).bfloat16()
    B = torch.randn(24, 8, generator=g).bfloat16()
    got = ops.low_rank_linear(x, A, B, bias)
    assert seen == [{compute}, {compute}]
    middle = F.linear(x.to(compute), A.to(compute))
    want = F.linear(middle, B.to(compute), bias.to(compute)).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
