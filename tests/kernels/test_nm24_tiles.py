"""Packed 2:4 float layers on tiles of 16 rows (``lmcompress/kernels/nm24_tiles.py``, the
``lmc_nm24_tiled_float`` kernel): the tiles are a lossless permutation of the stored tensors;
the kernel equals the reference to float rounding and its vector loop equals its plain loop bit
for bit, at 1-12 tokens, with and without bias, for every value and activation dtype; a
:class:`PackedNMLinear` holding tiles reads, writes, moves and computes as the stored one."""

from __future__ import annotations

import pytest
import torch
from conftest import requires_kernels

from lmcompress.compressor.formats.nm_packed import PackedNMLinear
from lmcompress.compressor.sparsity import nm_mask
from lmcompress.kernels import cpu_kernels, nm24_tiles
from lmcompress.kernels import reference as R

pytestmark = requires_kernels

SHAPES = [(16, 32), (48, 96), (32, 576)]  # one position word a row; three; 18 (SmolLM2's width)
TOKENS = [1, 2, 3, 4, 5, 9, cpu_kernels.MAX_TOKENS]


def _packed(out_features, in_features, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(out_features, in_features, generator=g)
    W = W * nm_mask(W.abs() + torch.rand(W.shape, generator=g), 2, 4)
    return R.pack_nm(W.to(dtype), 2, 4)


@pytest.mark.parametrize("shape", SHAPES)
def test_tiles_are_a_permutation_of_the_stored_tensors(shape):
    values, indices = _packed(*shape, torch.bfloat16)
    tiled_values, tiled_indices = nm24_tiles.tile(values, indices)
    assert tiled_values.shape == values.shape and tiled_indices.shape == indices.shape
    assert tiled_values.dtype == values.dtype and tiled_indices.dtype == torch.uint8
    back = nm24_tiles.untile(tiled_values, tiled_indices)
    assert torch.equal(back[0], values) and torch.equal(back[1], indices)
    # row 1's first value of group 0 is lane 1 of the tile's first 16 values; its second, lane 1
    # of the next 16; row 1's first position word is the tile's second word
    flat_values, flat_indices = tiled_values.flatten(), tiled_indices.flatten()
    assert flat_values[1] == values[1, 0] and flat_values[17] == values[1, 1]
    assert torch.equal(flat_indices[4:8], indices[1, 0:4])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("v_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_equals_the_reference_and_its_plain_loop(shape, v_dtype, x_dtype, with_bias):
    values, indices = _packed(*shape, v_dtype, seed=shape[1])
    tiled = nm24_tiles.tile(values, indices)
    dense = R.unpack_nm(values, indices, 2, 4, shape[1]).double()
    g = torch.Generator().manual_seed(1)
    bias = torch.randn(shape[0], generator=g).to(v_dtype) if with_bias else None
    for tokens in TOKENS:
        x = torch.randn(tokens, shape[1], generator=g).to(x_dtype)
        y = nm24_tiles.linear(x, *tiled, bias)
        assert y.dtype == x_dtype and y.shape == (tokens, shape[0])
        assert torch.equal(y, nm24_tiles.linear(x, *tiled, bias, vector=False))
        one_by_one = torch.cat(
            [nm24_tiles.linear(x[t : t + 1], *tiled, bias) for t in range(tokens)]
        )
        assert torch.equal(y, one_by_one)  # a token's sum does not depend on its neighbours
        ref = x.double() @ dense.T + (0 if bias is None else bias.double())
        tol = 1e-5 if x_dtype == torch.float32 else 1e-2  # float rounding; bf16 output rounding
        torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol * ref.abs().max())


def test_three_dimensional_input():
    values, indices = _packed(32, 64)
    tiled = nm24_tiles.tile(values, indices)
    x = torch.randn(2, 3, 64)
    y = nm24_tiles.linear(x, *tiled)
    assert y.shape == (2, 3, 32)
    assert torch.equal(y.reshape(6, 32), nm24_tiles.linear(x.reshape(6, 64), *tiled))


@pytest.mark.parametrize(
    "n, m, out_features, in_features",
    [(2, 4, 40, 64), (2, 4, 32, 48), (1, 4, 32, 64), (2, 8, 32, 64)],
)
def test_layers_that_do_not_fit_stay_stored(n, m, out_features, in_features):
    W = torch.randn(out_features, in_features)
    layer = PackedNMLinear.from_linear(_linear(W * nm_mask(W.abs(), n, m)), n, m)
    values = layer.values.clone()
    layer.tile()
    assert not layer.tiled and torch.equal(layer.values, values)


def _linear(W, bias=True):
    linear = torch.nn.Linear(W.shape[1], W.shape[0], bias=bias)
    linear.weight.data = W.clone()
    return linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_layer_reads_and_computes_as_the_stored_one(dtype):
    W = torch.randn(48, 96)
    stored = PackedNMLinear.from_linear(_linear(W * nm_mask(W.abs(), 2, 4)), 2, 4).to(dtype)
    tiled = PackedNMLinear.from_linear(_linear(W * nm_mask(W.abs(), 2, 4)), 2, 4).to(dtype)
    tiled.bias.data = stored.bias.data.clone()
    tiled.tile()
    assert tiled.tiled and "values" not in tiled._buffers
    assert torch.equal(tiled.values, stored.values) and torch.equal(tiled.indices, stored.indices)
    assert tiled.state_tensors().keys() == stored.state_tensors().keys()
    with torch.no_grad():
        for tokens in (1, 4, cpu_kernels.MAX_TOKENS, cpu_kernels.MAX_TOKENS + 1, 40):
            x = torch.randn(tokens, 96).to(dtype)
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            torch.testing.assert_close(tiled(x), stored(x), rtol=tol, atol=tol)
            if tokens <= cpu_kernels.MAX_TOKENS:  # the tiled kernel, not the stored path
                expect = nm24_tiles.linear(x, tiled.tiled_values, tiled.tiled_indices, tiled.bias)
                assert torch.equal(tiled(x), expect)
            else:  # more tokens: the stored layout's path, the same bits
                assert torch.equal(tiled(x), stored(x))
    moved = tiled.to(torch.float32)  # a cast runs on the stored layout, then tiles again
    assert moved.tiled and torch.equal(moved.values, stored.values.float())


def test_setting_values_untiles_the_layer():
    W = torch.randn(32, 64)
    layer = PackedNMLinear.from_linear(_linear(W * nm_mask(W.abs(), 2, 4)), 2, 4)
    layer.tile()
    doubled = layer.values * 2
    layer.values = doubled
    assert not layer.tiled and torch.equal(layer.values, doubled)
    x = torch.randn(1, 64)
    dense = R.unpack_nm(doubled, layer.indices, 2, 4, 64)
    torch.testing.assert_close(layer(x), x @ dense.T + layer.bias)


def test_prepare_decode_tiles_the_layers_that_fit():
    from lmcompress.compressor.formats.int4_shared import prepare_decode

    W = torch.randn(32, 64)
    fits = PackedNMLinear.from_linear(_linear(W * nm_mask(W.abs(), 2, 4)), 2, 4)
    W = torch.randn(40, 64)
    ragged = PackedNMLinear.from_linear(_linear(W * nm_mask(W.abs(), 2, 4)), 2, 4)
    model = torch.nn.Sequential(fits, ragged)
    prepare_decode(model)
    assert fits.tiled and not ragged.tiled


@pytest.mark.parametrize("tokens", [3, cpu_kernels.MAX_TOKENS + 4])
def test_a_compiled_tiled_layer_runs_the_eager_computation_bit_for_bit(tokens):
    """The graph holds ``lmcompress::nm24_decode``: the tiled kernel at few tokens (the stored
    layout's row kernel rounds differently), the stored path at more."""
    W = torch.randn(48, 96)
    layer = PackedNMLinear.from_linear(_linear(W * nm_mask(W.abs(), 2, 4)), 2, 4)  # fp32:
    stored = PackedNMLinear.from_linear(_linear(W * nm_mask(W.abs(), 2, 4)), 2, 4)  # roundings
    stored.bias.data = layer.bias.data.clone()  # differ (bf16 outputs would hide it)
    layer.tile()
    x = torch.randn(tokens, 96)
    torch._dynamo.reset()
    with torch.inference_mode():
        assert torch.equal(torch.compile(layer, dynamic=False)(x), layer(x))
        if tokens <= cpu_kernels.MAX_TOKENS:  # the test can tell the two kernels apart
            assert not torch.equal(layer(x), stored(x))
