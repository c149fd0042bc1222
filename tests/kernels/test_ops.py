"""torch.ops.lmcompress.nm_linear: the registered op against the reference, its fake
implementation (opcheck), its backward against autograd through the dense weight."""

import pytest
import torch

import lmcompress.kernels.ops  # noqa: F401  (registers the op)
from lmcompress.compressor.sparsity import nm_mask
from lmcompress.kernels.reference import gather_nm, pack_nm, unpack_nm


def _packed(out_features, in_features, n, m, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    W = torch.randn(out_features, in_features)
    W = (W * nm_mask(W.abs(), n, m)).to(dtype)
    values, indices = pack_nm(W, n, m)
    return W, values, indices


@pytest.mark.parametrize(("n", "m"), [(2, 4), (1, 4), (4, 8), (3, 7)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_op_matches_dense_linear(n, m, with_bias):
    W, values, indices = _packed(23, m * 9, n, m)
    bias = torch.randn(23) if with_bias else None
    x = torch.randn(2, 5, m * 9)
    y = torch.ops.lmcompress.nm_linear(x, values, indices, n, m, m * 9, bias)
    assert y.shape == (2, 5, 23)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, W, bias), rtol=1e-5, atol=1e-6)


def test_gather_is_the_adjoint_of_unpack():
    """<unpack(v), D> == <v, gather(D)> for any dense D: what makes it the values' gradient."""
    _, values, indices = _packed(11, 24, 2, 4)
    D = torch.randn(11, 24, dtype=torch.float64)
    v = torch.randn_like(values, dtype=torch.float64)
    lhs = (unpack_nm(v, indices, 2, 4, 24) * D).sum()
    rhs = (v * gather_nm(D, indices, 2, 4)).sum()
    torch.testing.assert_close(lhs, rhs)


def test_backward_matches_autograd_through_the_dense_weight():
    _, values, indices = _packed(12, 32, 2, 4, seed=1, dtype=torch.float64)
    bias = torch.randn(12, dtype=torch.float64, requires_grad=True)
    x = torch.randn(3, 4, 32, dtype=torch.float64, requires_grad=True)
    values = values.clone().requires_grad_(True)
    y = torch.ops.lmcompress.nm_linear(x, values, indices, 2, 4, 32, bias)
    grads = torch.autograd.grad((y * y.detach().cos()).sum(), (x, values, bias))

    x_ref, v_ref, b_ref = (t.detach().clone().requires_grad_(True) for t in (x, values, bias))
    y_ref = torch.nn.functional.linear(x_ref, unpack_nm(v_ref, indices, 2, 4, 32), b_ref)
    grads_ref = torch.autograd.grad((y_ref * y_ref.detach().cos()).sum(), (x_ref, v_ref, b_ref))
    for got, want in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(got, want)
    assert torch.autograd.gradcheck(
        lambda a, v, b: torch.ops.lmcompress.nm_linear(a, v, indices, 2, 4, 32, b),
        (x[:1, :2].detach().requires_grad_(True), values, bias),
    )


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("with_bias", [True, False])
def test_opcheck(requires_grad, with_bias):
    """Schema, fake tensor, autograd registration and AOT dispatch (what torch.compile uses)."""
    _, values, indices = _packed(8, 16, 2, 4)
    x = torch.randn(3, 16, requires_grad=requires_grad)
    bias = torch.randn(8, requires_grad=requires_grad) if with_bias else None
    torch.library.opcheck(
        torch.ops.lmcompress.nm_linear.default,
        (x, values.requires_grad_(requires_grad), indices, 2, 4, 16, bias),
    )


def test_wrong_input_width_is_refused():
    _, values, indices = _packed(8, 16, 2, 4)
    with pytest.raises(RuntimeError, match="input has 12 features"):
        torch.ops.lmcompress.nm_linear(torch.randn(2, 12), values, indices, 2, 4, 16, None)


def test_compiles_fullgraph_and_matches_eager():
    W, values, indices = _packed(8, 16, 2, 4)

    def f(x):
        return torch.ops.lmcompress.nm_linear(x, values, indices, 2, 4, 16, None).relu()

    x = torch.randn(4, 16)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), torch.nn.functional.linear(x, W).relu())
