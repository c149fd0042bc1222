import pytest
import torch

from lmcompress.compressor.sparsity import nm_mask
from lmcompress.errors import ConfigError
from lmcompress.kernels.reference import (
    index_bits,
    nm_linear,
    pack_nm,
    packed_nm_nbytes,
    unpack_nm,
)


@pytest.mark.parametrize(("n", "m"), [(2, 4), (1, 4), (4, 8), (3, 7), (1, 2), (8, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_pack_unpack_is_bit_exact(n, m, dtype):
    torch.manual_seed(0)
    W = torch.randn(19, m * 13).to(dtype)
    W = W * nm_mask(W.float().abs(), n, m)
    W[0, :m] = 0  # a group with fewer than n nonzeros
    values, indices = pack_nm(W, n, m)
    assert values.shape == (19, 13 * n) and values.dtype == dtype
    assert indices.dtype == torch.uint8
    assert torch.equal(unpack_nm(values, indices, n, m, W.shape[1]), W)
    assert values.numel() * values.element_size() + indices.numel() == packed_nm_nbytes(
        tuple(W.shape), n, m, dtype
    )


def test_2_4_fp16_is_56_percent_of_dense():
    shape = (576, 1536)
    ratio = packed_nm_nbytes(shape, 2, 4, torch.float16) / (576 * 1536 * 2)
    assert ratio == pytest.approx(0.5625)
    assert index_bits(4) == 2 and index_bits(8) == 4 and index_bits(2) == 1


def test_positions_are_stored_in_increasing_order():
    W = torch.tensor([[0.0, 5.0, 0.0, 7.0]])
    values, indices = pack_nm(W, 2, 4)
    assert values.tolist() == [[5.0, 7.0]]
    assert indices.tolist() == [[1 | (3 << 2)]]  # positions 1 and 3, low bits first


def test_pack_refuses_dense_groups_and_bad_widths():
    with pytest.raises(ConfigError, match="not 2:4 sparse"):
        pack_nm(torch.ones(2, 8), 2, 4)
    with pytest.raises(ConfigError, match="not divisible"):
        pack_nm(torch.zeros(2, 6), 2, 4)


def test_nm_linear_reference_matches_dense():
    torch.manual_seed(1)
    W = torch.randn(24, 64)
    W = W * nm_mask(W.abs(), 2, 4)
    bias = torch.randn(24)
    x = torch.randn(3, 5, 64)
    values, indices = pack_nm(W, 2, 4)
    out = nm_linear(x, values, indices, 2, 4, 64, bias)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, W, bias))
