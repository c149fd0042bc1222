"""The Triton kernel of lmcompress::nm_linear against the reference: bit for bit on integer-valued
data, where every sum is exact, for every layout the kernel reads; to fp16/bf16 rounding on random
data; irregular shapes, odd strides, split-K, the op's CUDA entry point and its fallbacks, one-line
errors. Without a GPU the kernel runs in Triton's interpreter on CPU tensors (conftest.py); on a
GPU it is compiled, the interpreter tests skip and the ``gpu`` tests launch it on CUDA tensors."""

import pytest
import torch

from lmcompress.compressor.sparsity import nm_mask
from lmcompress.errors import ConfigError
from lmcompress.kernels import ops
from lmcompress.kernels.reference import nm_linear, pack_nm

pytest.importorskip("triton")
from lmcompress.kernels import nm_linear_triton as nmt  # noqa: E402  (after the interpreter is chosen)

INTERPRETER = pytest.mark.skipif(
    not nmt.interpreted(),
    reason="launches the kernel on CPU tensors: Triton's interpreter (no GPU, see conftest.py)",
)
CUDA = pytest.mark.skipif(
    not torch.cuda.is_available() or nmt.interpreted(),
    reason="needs a CUDA device and the compiled kernel (TRITON_INTERPRET unset)",
)


def _sparse(out_features, in_features, n, m, seed, integer=False, holes=0.0):
    """An ``n:m``-sparse ``(out, in)`` weight: integers in [-3, 3] (``integer``) or normal, with a
    fraction ``holes`` of its kept weights zeroed (groups with fewer than ``n`` nonzeros)."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randint(-3, 4, (out_features, in_features), generator=g).float()
    if not integer:
        W = torch.randn(out_features, in_features, generator=g)
    W = W * nm_mask(W.abs() + torch.rand(W.shape, generator=g), n, m)  # ties broken at random
    if holes:
        W = W * (torch.rand(W.shape, generator=g) >= holes)
    return W


def _inputs(shape, seed, integer=False):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2, 3, shape, generator=g).float() if integer else torch.randn(shape)


# (n, m, tokens, out, in): every layout the kernel reads (fast path: n in 1, 2, 4 and m in 2, 4,
# 8; the general path: the others), tokens and out features off the tile sizes, in features
# ending inside a K tile (BLOCK_K = 64) after one or more whole ones.
LAYOUTS = [
    (2, 4, 5, 23, 100),
    (1, 4, 3, 17, 68),
    (4, 8, 7, 9, 136),
    (1, 2, 2, 33, 50),
    (1, 8, 4, 5, 72),
    (3, 4, 3, 11, 52),
    (3, 7, 2, 13, 91),
    (5, 6, 17, 7, 42),
    (2, 3, 1, 19, 33),
]


@INTERPRETER
@pytest.mark.parametrize(("n", "m", "tokens", "out_features", "in_features"), LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_equals_reference_exactly_on_integer_data(
    n, m, tokens, out_features, in_features, dtype
):
    W = _sparse(out_features, in_features, n, m, seed=m * 10 + n, integer=True, holes=0.2)
    values, indices = pack_nm(W.to(dtype), n, m)
    x = _inputs((tokens, in_features), seed=n, integer=True).to(dtype)
    bias = _inputs((out_features,), seed=3, integer=True).to(dtype)
    assert nmt.fast_path(n, m) == (n in (1, 2, 4) and m in (2, 4, 8))
    for b in (bias, None):
        y = nmt.nm_linear_triton(x, values, indices, n, m, in_features, b)
        assert y.dtype == dtype and y.shape == (tokens, out_features)
        assert torch.equal(y, nm_linear(x, values, indices, n, m, in_features, b))


@INTERPRETER
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kernel_matches_reference_on_random_data(dtype):
    """Two K tiles and a tail, 3-D input, bias; bf16 multiplied in fp32 after loading (the
    interpreter's bf16 arithmetic is wrong), so all three round only their output."""
    W = _sparse(37, 136, 2, 4, seed=1)
    values, indices = pack_nm(W.to(dtype), 2, 4)
    g = torch.Generator().manual_seed(2)  # not the global generator: the test's data is fixed
    x = torch.randn(2, 7, 136, generator=g).to(dtype)
    bias = torch.randn(37, generator=g).to(dtype)
    y = nmt.nm_linear_triton(x, values, indices, 2, 4, 136, bias)
    assert y.shape == (2, 7, 37) and y.dtype == dtype
    Wd = W.to(dtype).double()
    want = torch.nn.functional.linear(x.double(), Wd, bias.double())
    eps = torch.finfo(dtype).eps
    # float accumulation in another order than float64's: eps times the sum of |terms| bounds it
    magnitude = torch.nn.functional.linear(x.double().abs(), Wd.abs(), bias.double().abs())
    torch.testing.assert_close(y.double(), want, rtol=eps, atol=eps * magnitude.max().item())
    ref = nm_linear(x, values, indices, 2, 4, 136, bias)
    torch.testing.assert_close(y, ref, rtol=2 * eps, atol=2 * eps * ref.abs().max().item())


@INTERPRETER
def test_non_contiguous_inputs_and_packed_tensors():
    W = _sparse(21, 96, 2, 4, seed=2, integer=True)
    values, indices = pack_nm(W, 2, 4)
    wide = _inputs((6, 2 * 96), seed=4, integer=True)
    cases = {
        "strided x": wide[:, ::2],
        "transposed x": wide[:, :96].t().contiguous().t(),
        "x rows skipped": wide.reshape(12, 96)[::2],
    }
    col_major_values = values.t().contiguous().t()  # strides (1, out)
    col_major_indices = indices.t().contiguous().t()
    assert not col_major_values.is_contiguous() and not col_major_indices.is_contiguous()
    for name, x in cases.items():
        assert not x.is_contiguous(), name
        want = nm_linear(x, values, indices, 2, 4, 96)
        got = nmt.nm_linear_triton(x, col_major_values, col_major_indices, 2, 4, 96)
        assert torch.equal(got, want), name


@INTERPRETER
def test_one_token_and_split_k():
    """Decode: one token, K cut into slices whose fp32 partial sums are added afterwards."""
    W = _sparse(40, 256, 2, 4, seed=5, integer=True, holes=0.3)
    values, indices = pack_nm(W.half(), 2, 4)
    x = _inputs((1, 256), seed=6, integer=True).half()
    bias = torch.arange(40.0).half()
    want = nm_linear(x, values, indices, 2, 4, 256, bias)
    for split_k in (1, 3, 4):  # 3 does not divide the 4 K tiles; 4 gives each tile a slice
        got = nmt.nm_linear_triton(x, values, indices, 2, 4, 256, bias, split_k=split_k)
        assert got.dtype == torch.float16 and torch.equal(got, want), split_k
    assert nmt.split_k_for(1, 40, 256, x.device) == 1  # CPU: no SMs to fill


@INTERPRETER
@pytest.mark.parametrize(("n", "m"), [(2, 4), (1, 8), (3, 7)])
def test_several_tiles_in_both_directions_and_grouped_order(n, m):
    """16 × 16 × 16 tiles: 3 × 3 output tiles, visited in groups of 2 tile rows (the last group
    short), 3 K tiles, each a whole number of position bytes for 2:4 and 1:8."""
    config = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2}
    in_features = m * (40 // m)  # 40 or 35: 3 K tiles, the last one short
    W = _sparse(45, in_features, n, m, seed=7, integer=True)
    values, indices = pack_nm(W, n, m)
    x = _inputs((37, in_features), seed=8, integer=True)
    got = nmt.nm_linear_triton(x, values, indices, n, m, in_features, config=config)
    assert torch.equal(got, nm_linear(x, values, indices, n, m, in_features))


def test_empty_inputs_give_the_bias():
    W = _sparse(6, 16, 2, 4, seed=9)
    values, indices = pack_nm(W, 2, 4)
    bias = torch.randn(6)
    y = nmt.nm_linear_triton(torch.zeros(0, 16), values, indices, 2, 4, 16, bias)
    assert y.shape == (0, 6)
    y = nmt.nm_linear_triton(torch.zeros(2, 3, 16), values[:0], indices[:0], 2, 4, 16)
    assert y.shape == (2, 3, 0)


@INTERPRETER
def test_cuda_entry_point_runs_the_kernel_and_falls_back_to_the_reference(monkeypatch):
    """``_nm_linear_cuda`` is what the dispatcher calls for CUDA tensors; here it gets CPU tensors
    and the interpreter. Layouts the kernel does not read (M > 8, float64) take the reference."""
    assert torch._C._dispatch_has_kernel_for_dispatch_key("lmcompress::nm_linear", "CUDA")
    calls = []
    launch = nmt.nm_linear_triton
    monkeypatch.setattr(nmt, "nm_linear_triton", lambda *a: calls.append(a[3:5]) or launch(*a))
    for n, m, dtype in ((2, 4, torch.float32), (4, 16, torch.float32), (2, 4, torch.float64)):
        W = _sparse(8, 32, n, m, seed=10, integer=True)
        values, indices = pack_nm(W.to(dtype), n, m)
        x = _inputs((3, 32), seed=11, integer=True).to(dtype)
        want = nm_linear(x, values, indices, n, m, 32)
        assert torch.equal(ops._nm_linear_cuda(x, values, indices, n, m, 32), want)
    assert calls == [(2, 4)]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"n": 4, "m": 16, "in_features": 32}, "needs 0 < N < M <= 8"),
        ({"in_features": 30}, "input has 32 features"),
        ({"values": torch.zeros(8, 12)}, "do not hold 2:4"),
        ({"indices": torch.zeros(8, 4, dtype=torch.int32)}, "indices must be uint8"),
        ({"x": torch.zeros(2, 32, dtype=torch.float64)}, "must be fp16, bf16 or fp32"),
        ({"bias": torch.zeros(7)}, "bias (7,) for 8 outputs"),
        ({"config": {"BLOCK_M": 16, "BLOCK_N": 24, "BLOCK_K": 16, "GROUP_M": 1}}, "powers of two"),
    ],
)
def test_bad_inputs_are_one_line_errors(change, message):
    values, indices = pack_nm(_sparse(8, 32, 2, 4, seed=12), 2, 4)
    call = {"x": torch.zeros(2, 32), "values": values, "indices": indices, "n": 2, "m": 4}
    call.update(in_features=32, bias=None)
    call.update(change)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        nmt.nm_linear_triton(**call)
    assert "\n" not in str(err.value)


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize(("n", "m", "tokens", "out_features", "in_features"), LAYOUTS)
def test_compiled_kernel_on_cuda_equals_the_reference_exactly(
    n, m, tokens, out_features, in_features
):
    """Every layout, compiled: the launch on CUDA tensors against the reference on CPU, equal
    on integer-valued fp16 data (every product and sum is exact in the fp32 accumulator)."""
    W = _sparse(out_features, in_features, n, m, seed=m * 10 + n, integer=True, holes=0.2)
    values, indices = pack_nm(W.half(), n, m)
    x = _inputs((tokens, in_features), seed=n, integer=True).half()
    bias = _inputs((out_features,), seed=3, integer=True).half()
    want = nm_linear(x, values, indices, n, m, in_features, bias)
    cuda = [t.cuda() for t in (x, values, indices, bias)]
    y = nmt.nm_linear_triton(*cuda[:3], n, m, in_features, cuda[3])
    assert y.is_cuda and torch.equal(y.cpu(), want)


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("tokens", [1, 16, 200])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_packed_layer_on_cuda_runs_the_kernel(tokens, dtype, monkeypatch):
    """On a GPU: ``PackedNMLinear`` dispatches to the autotuned kernel (decode and prefill
    configurations): a spy sees the launch and the reference is never called. The output
    matches the dense product computed in float64 to the dtype's rounding."""
    from lmcompress.compressor.formats.nm_packed import PackedNMLinear
    from lmcompress.kernels import reference

    linear = torch.nn.Linear(1024, 384).to("cuda", dtype)
    with torch.no_grad():
        linear.weight *= nm_mask(linear.weight.abs(), 2, 4)
    layer = PackedNMLinear.from_linear(linear, 2, 4)
    launches, launch = [], nmt.nm_linear_triton
    monkeypatch.setattr(
        nmt, "nm_linear_triton", lambda *a, **k: launches.append(a[3:5]) or launch(*a, **k)
    )

    def no_reference(*_args, **_kwargs):
        raise AssertionError("the reference ran instead of the kernel")

    monkeypatch.setattr(reference, "nm_linear", no_reference)
    x = torch.randn(tokens, 1024, device="cuda", dtype=dtype)
    with torch.no_grad():
        y = layer(x)
    assert launches == [(2, 4)] and y.dtype == dtype and y.shape == (tokens, 384)
    want = torch.nn.functional.linear(x.double(), linear.weight.double(), linear.bias.double())
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(y.double(), want, rtol=eps, atol=eps * want.abs().max().item())
