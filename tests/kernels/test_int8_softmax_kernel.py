"""lmcompress::int8_softmax: the reference against torch's softmax, the Triton kernel against the
reference bit for bit, the offset only where keys are allowed, ties rounded to even, one-line
errors. Without a GPU the kernel runs in Triton's interpreter on CPU tensors (conftest.py); on a
GPU it is compiled, the interpreter tests skip and the ``gpu`` test runs the op on CUDA tensors."""

import pytest
import torch

from lmcompress.errors import ConfigError
from lmcompress.kernels.int8_softmax import int8_softmax_triton
from lmcompress.kernels.reference import (
    exp_reference,
    int8_softmax_reference,
    int8_softmax_values,
)

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from lmcompress.kernels import triton_softmax  # noqa: E402  (after the interpreter is chosen)

INTERPRETED = isinstance(triton_softmax.int8_softmax_kernel, InterpretedFunction)
INTERPRETER = pytest.mark.skipif(
    not INTERPRETED,
    reason="launches the kernel on CPU tensors: Triton's interpreter (no GPU, see conftest.py)",
)

NEG = float("-inf")


def _kernel(scores, mask=None, offset=None, scale=1 / 255, values=None):
    # Big tiles: the interpreter's cost is per operation, not per element.
    return int8_softmax_triton(scores, mask, offset, scale, rows_per_program=64, values=values)


def _causal(q_len, k_len, dtype=torch.float32):
    keep = torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len)
    return torch.zeros(q_len, k_len, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min)


def _case(name):
    """(scores, mask, offset, scale) of one named case; scores scaled so rows are peaked."""
    g = torch.Generator().manual_seed(len(name))
    if name == "irregular 4-D, per-head offset":
        return (
            torch.randn(2, 3, 17, 33, generator=g) * 3,
            None,
            torch.randn(3, generator=g),
            1 / 255,
        )
    if name == "2-D, one offset, scale 1/256":
        return torch.randn(37, 129, generator=g) * 4, None, torch.tensor(0.01), 1 / 256
    if name == "length-1 rows":
        scores = torch.randn(2, 2, 5, 1, generator=g)
        return scores, torch.zeros(1, 1, 5, 1), torch.full((2, 2), 0.3), 1 / 255
    if name == "causal bf16":
        scores = (torch.randn(1, 2, 40, 70, generator=g) * 5).bfloat16()
        return (
            scores,
            _causal(40, 70, torch.bfloat16)[None, None],
            torch.randn(2, generator=g),
            1 / 255,
        )
    if name == "padding fp16, (B, 1) offset":
        mask = torch.zeros(2, 1, 1, 24, dtype=torch.float16)
        mask[1, ..., :7] = NEG  # left padding of the second sequence
        scores = (torch.randn(2, 1, 24, 24, generator=g) * 2).half()
        return scores, mask, torch.tensor([[0.02], [-0.01]]), 1 / 255
    if name == "boolean mask, 3-D scores":
        keep = torch.rand(9, 100, generator=g) > 0.3
        return torch.randn(3, 9, 100, generator=g) * 6, keep, torch.randn(3, generator=g), 1 / 255
    if name == "-inf rows and fully masked rows":
        scores = torch.randn(1, 2, 6, 50, generator=g)
        scores[0, 0, 2] = NEG  # every score -inf: zeros
        mask = _causal(6, 50)[None, None].repeat(1, 2, 1, 1)
        mask[0, 1, 4] = torch.finfo(torch.float32).min  # eager makes it uniform, no offset
        return scores, mask, torch.tensor([0.5, -0.25]), 1 / 255
    raise KeyError(name)


CASES = [
    "irregular 4-D, per-head offset",
    "2-D, one offset, scale 1/256",
    "length-1 rows",
    "causal bf16",
    "padding fp16, (B, 1) offset",
    "boolean mask, 3-D scores",
    "-inf rows and fully masked rows",
]


@INTERPRETER
@pytest.mark.parametrize("name", CASES)
def test_kernel_equals_reference_bit_for_bit(name):
    scores, mask, offset, scale = _case(name)
    q_ref, out_ref, v_ref = int8_softmax_values(scores, mask, offset, scale, keep_values=True)
    v = torch.empty(scores.shape)
    q, out = _kernel(scores, mask, offset, scale, values=v)
    assert q.dtype == torch.uint8 and out.dtype == torch.float32
    assert q.shape == out.shape == scores.shape
    # v = p / scale before rounding: a different exp or summation order shows in its last bits,
    # where q and out would only show it on the rare near-tie.
    assert torch.equal(v, v_ref)
    assert torch.equal(q, q_ref)
    assert torch.equal(out, out_ref)
    assert int(q.max()) > 0


@pytest.mark.parametrize("name", CASES)
def test_reference_is_softmax_rounded(name):
    """q * scale is the float softmax to within half a step (plus the exp's ~1e-6), and equals
    round(softmax / scale) everywhere but on near-ties."""
    scores, mask, offset, scale = _case(name)
    q, out = int8_softmax_reference(scores, mask, offset, scale)
    x = scores.float()
    if mask is not None:
        additive = (
            mask if mask.dtype != torch.bool else torch.zeros(mask.shape).masked_fill(~mask, NEG)
        )
        x = x + additive.float()
    empty = (x == NEG).all(-1, keepdim=True)
    p = torch.softmax(x, -1).masked_fill(empty, 0.0)  # torch gives NaN on -inf rows
    assert ((q.float() * scale - p).abs() <= scale / 2 + 1e-5).all()
    want = torch.round(p / scale).clamp(max=255)
    assert (q.float() - want).abs().max() <= 1
    assert (q.float() != want).float().mean() < 1e-3


def test_exp_reference_is_close_to_exp():
    x = torch.cat(
        [-torch.rand(100_000, generator=torch.Generator().manual_seed(0)) * 87, torch.zeros(1)]
    )
    got, want = exp_reference(x).double(), torch.exp(x.double())
    assert ((got - want).abs() / want <= 1.2e-7 * (1 + x.abs().double())).all()
    special = exp_reference(torch.tensor([0.0, NEG, -88.0, -1e30]))
    assert special.tolist() == [1.0, 0.0, 0.0, 0.0]


@triton.jit
def _apply(x_ptr, y_ptr, n, WHICH: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    if WHICH == 0:
        y = triton_softmax.exp_poly(x)
    else:
        y = triton_softmax.round_half_even(x)
    tl.store(y_ptr + offs, y, mask=offs < n)


def _run_helper(x, which):
    y = torch.empty_like(x)
    _apply[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), WHICH=which, BLOCK=1024)
    return y


@INTERPRETER
def test_kernel_exp_equals_reference():
    g = torch.Generator().manual_seed(1)
    special = torch.tensor([0.0, -0.0, NEG, -88.0, -87.9, -87.3, -1e-30, -1e30, -0.6931472])
    x = torch.cat([special, -torch.rand(3000, generator=g) * 90, -torch.rand(1000, generator=g)])
    assert torch.equal(_run_helper(x, 0), exp_reference(x))


@INTERPRETER
def test_rounding_is_half_to_even_as_torch_round():
    below_half = torch.nextafter(torch.tensor(0.5), torch.tensor(0.0))  # 0.49999997: x + 0.5 -> 1
    ties = torch.arange(0, 256).float() + 0.5
    near = torch.cat([torch.nextafter(ties, ties + 1), torch.nextafter(ties, ties - 1)])
    x = torch.cat([below_half[None], ties, near, torch.rand(2000) * 260, torch.tensor([0.0, 1e9])])
    got = _run_helper(x, 1)
    assert torch.equal(got, torch.round(x))
    assert got[1:5].tolist() == [0.0, 2.0, 2.0, 4.0]  # 0.5 1.5 2.5 3.5 (half up: 1 2 3 4)


@INTERPRETER
@pytest.mark.parametrize("length", [256, 128])
def test_uniform_rows_round_ties_to_even(length):
    """A uniform row of 256 keys at scale 1/128 gives p / scale = 0.5 exactly: q = 0 (half to
    even), where floor(v + 0.5) would give 1; 128 keys give exactly 1."""
    scores = torch.zeros(3, length)
    for q, _ in (int8_softmax_reference(scores, scale=1 / 128), _kernel(scores, scale=1 / 128)):
        assert (q == 128 // length).all()


@INTERPRETER
def test_offset_only_on_allowed_keys_and_causal():
    scores = torch.randn(2, 3, 10, 10, generator=torch.Generator().manual_seed(2)) * 2
    mask = _causal(10, 10)[None, None]
    offset = torch.tensor([0.1, -0.2, 0.3])
    allowed = (mask == 0).expand(scores.shape)
    for fn in (int8_softmax_reference, _kernel):
        q, out = fn(scores, mask, offset, 1 / 255)
        shift = out - q.float() * torch.tensor(1 / 255)
        assert torch.equal(out[~allowed], torch.zeros(int((~allowed).sum())))  # q = 0 there
        want = torch.where(allowed, offset[:, None, None], 0.0)
        torch.testing.assert_close(shift, want, rtol=0, atol=1e-7)
        future = scores.clone()
        future[~allowed] = torch.randn(int((~allowed).sum())) * 10  # change what is masked
        q2, out2 = fn(future, mask, offset, 1 / 255)
        assert torch.equal(q2, q) and torch.equal(out2, out)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or INTERPRETED,
    reason="needs a CUDA device and the compiled kernel (TRITON_INTERPRET unset)",
)
@pytest.mark.parametrize("name", CASES)
def test_op_on_cuda_runs_the_kernel_bit_for_bit(name, monkeypatch):
    """On a GPU the op dispatches to the compiled kernel (a spy sees the launch, the reference
    is not called), which equals the reference computed on CPU bit for bit (the op's contract:
    every step a single IEEE float32 operation, no FMA contraction)."""
    import lmcompress.kernels.int8_softmax as module

    scores, mask, offset, scale = _case(name)
    q_ref, out_ref = int8_softmax_reference(scores, mask, offset, scale)  # CPU
    launches, launch = [], module.int8_softmax_triton
    monkeypatch.setattr(
        module,
        "int8_softmax_triton",
        lambda *a, **k: launches.append(a[0].device) or launch(*a, **k),
    )

    def no_reference(*_args, **_kwargs):
        raise AssertionError("the reference ran instead of the kernel")

    monkeypatch.setattr(module, "int8_softmax_reference", no_reference)
    cuda = [None if t is None else t.cuda() for t in (scores, mask, offset)]
    q, out = torch.ops.lmcompress.int8_softmax(*cuda, scale)
    assert [d.type for d in launches] == ["cuda"] and q.is_cuda
    assert torch.equal(q.cpu(), q_ref) and torch.equal(out.cpu(), out_ref)


def test_op_runs_the_reference_on_cpu_and_passes_opcheck():
    scores, mask, offset, scale = _case("causal bf16")
    q, out = torch.ops.lmcompress.int8_softmax(scores, mask, offset, scale)
    q_ref, out_ref = int8_softmax_reference(scores, mask, offset, scale)
    assert torch.equal(q, q_ref) and torch.equal(out, out_ref)
    torch.library.opcheck(torch.ops.lmcompress.int8_softmax.default, (scores, mask, offset, scale))
    torch.library.opcheck(
        torch.ops.lmcompress.int8_softmax.default, (scores[0, 0], None, None, 0.5)
    )


@pytest.mark.parametrize(
    ("scores", "mask", "offset", "scale", "message"),
    [
        (torch.zeros(2, 4), None, None, 0.0, "scale must be in"),
        (torch.zeros(2, 4), None, None, -1 / 255, "scale must be in"),
        (torch.zeros(2, 4), None, None, 2.0, "scale must be in"),
        (torch.zeros(2, 4), None, None, float("nan"), "scale must be in"),
        (torch.zeros(4), None, None, 1 / 255, "2 to 4 dimensions"),
        (torch.zeros(1, 1, 1, 2, 4), None, None, 1 / 255, "2 to 4 dimensions"),
        (torch.zeros(2, 4, dtype=torch.int32), None, None, 1 / 255, "must be float"),
        (torch.zeros(3, 2, 4), torch.zeros(2, 5), None, 1 / 255, "mask (2, 5)"),
        (torch.zeros(1, 3, 2, 4), None, torch.zeros(4), 1 / 255, "offset (4,)"),
    ],
)
def test_bad_inputs_are_one_line_errors(scores, mask, offset, scale, message):
    for fn in (torch.ops.lmcompress.int8_softmax, _kernel):
        with pytest.raises(
            ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")
        ) as err:
            fn(scores, mask, offset, scale)
        assert "\n" not in str(err.value)
