"""The ``torch.library`` ops behind lmcompress's compressed modules.

One op name per computation, so that every call site (``PackedNMLinear.forward``, tests,
benchmarks) runs everywhere through the same dispatcher entry:

- the default implementation (any device without a kernel of its own) is the pure-torch
  reference in :mod:`lmcompress.kernels.reference`, the specification;
- on CPU, :func:`nm_linear_cpu`: the compiled kernels of :mod:`lmcompress.kernels.cpu_kernels`
  (read the packed form for a few tokens; unpack once per call, then torch's matmul, for
  more: in float32 for bf16 on a CPU that emulates bf16 matmuls, :mod:`~lmcompress.kernels.
  gemm_dtype`), the reference where they are unavailable. ``PackedNMLinear`` calls it directly in
  eager mode (no dispatch cost, ~20 µs a call);
- ``register_fake`` gives shapes and dtypes without computing, so ``torch.compile(fullgraph=True)``
  traces through the op instead of breaking the graph;
- ``register_autograd`` gives the backward in closed form (custom ops are opaque to autograd);
- a device kernel registers under the same name with ``register_kernel``: on CUDA, the Triton
  kernel of :mod:`lmcompress.kernels.nm_linear_triton` (``register_kernel``, not
  ``triton_op``, which breaks ``torch.compile`` on CPU under fake tensors).

Importing this module registers the ops (``torch.library`` is process-global, so it happens once,
on the first import). This file has no ``from __future__ import annotations``: ``custom_op``
reads the schema from the real annotations.
"""

import functools
import logging

import torch
import torch.nn.functional as F

from lmcompress.kernels import cpu_kernels, gemm_dtype, int4_ops, reference
from lmcompress.kernels.int8_ops import int8_matmul

logger = logging.getLogger(__name__)


@torch.library.custom_op("lmcompress::nm_linear", mutates_args=())
def nm_linear(
    x: torch.Tensor,
    values: torch.Tensor,
    indices: torch.Tensor,
    n: int,
    m: int,
    in_features: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W.T + bias`` for ``W`` in packed N:M form (``reference.pack_nm``), in ``x``'s dtype.

    Shapes: ``x (..., in)``, ``values (out, in * n / m)``, ``indices`` uint8 ``(out, ·)``,
    ``bias (out,)`` or ``None``; returns ``(..., out)``.
    """
    _check(x, values, n, m, in_features)
    return reference.nm_linear(x, values, indices, n, m, in_features, bias)


def eager_cpu(x: torch.Tensor) -> bool:
    """Whether a layer may call a CPU computation directly instead of through its op: on CPU,
    not while ``torch.compile`` traces (the compiled kernels are opaque to it: the op is
    what a graph holds), and not where autograd needs the op's backward."""
    return (
        x.device.type == "cpu"
        and not torch.compiler.is_compiling()
        and not (x.requires_grad and torch.is_grad_enabled())
    )


def few_tokens_cpu(x: torch.Tensor, in_features: int, max_tokens: int) -> bool:
    """Whether a layer may run one of :mod:`~lmcompress.kernels.cpu_kernels`' few-token
    kernels on ``x`` (..., in): :func:`eager_cpu`, ``x`` fp32 or bf16, at most ``max_tokens``
    rows, and the kernels built."""
    return (
        eager_cpu(x)
        and x.dtype in (torch.float32, torch.bfloat16)
        and x.numel() <= max_tokens * in_features
        and cpu_kernels.library() is not None
    )


def low_rank_linear(
    x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``(x Aᵀ) Bᵀ + bias`` for ``x`` (..., in): the low-rank kernel for a few tokens on CPU
    (fp32 accumulation, so equal to torch's two linears to float rounding), else torch."""
    in_features = A.shape[1]
    if (
        few_tokens_cpu(x, in_features, cpu_kernels.LOW_RANK_MAX_TOKENS)
        and A.dtype == B.dtype == x.dtype
        and not ((A.requires_grad or B.requires_grad) and torch.is_grad_enabled())
    ):
        y = cpu_kernels.lowrank(x.reshape(-1, in_features), A, B, bias)
        return y.reshape(*x.shape[:-1], B.shape[0])
    compute = gemm_dtype.compute_dtype(x)  # bf16 on a CPU that emulates it: float32
    if compute != x.dtype:
        part = None if bias is None else bias.to(compute)
        return F.linear(F.linear(x.to(compute), A.to(compute)), B.to(compute), part).to(x.dtype)
    return F.linear(F.linear(x, A), B, bias)  # (..., r) then (..., out)


def bad_positions(indices: torch.Tensor, n: int, m: int, kept: int) -> str | None:
    """:func:`reference.bad_positions` (the load-time check of packed position codes), its byte
    lookups by the compiled CPU kernel where there is one (one pass, ~10× faster)."""
    fast = None
    if indices.device.type == "cpu" and cpu_kernels.library() is not None:
        fast = cpu_kernels.first_bad_byte
    return reference.bad_positions(indices, n, m, kept, fast)


@torch.library.custom_op("lmcompress::nm_int8_matmul", mutates_args=())
def nm_int8_matmul(
    x_q: torch.Tensor, values: torch.Tensor, indices: torch.Tensor, n: int, m: int, in_features: int
) -> torch.Tensor:
    """``x_q @ W.T`` as exact int32, for int8 ``x_q`` (tokens, in) and ``W`` the packed N:M
    int8 codes ``values``/``indices``: the integer half of a 2:4 + int8 layer. Equal to
    ``torch._int_mm`` of the unpacked codes (integers: the order of the sum does not matter)."""
    torch._check(
        x_q.dim() == 2 and x_q.shape[1] == in_features and values.dtype == torch.int8,
        lambda: f"nm_int8_matmul: x {tuple(x_q.shape)}, values {values.dtype}, in={in_features}",
    )
    return nm_int8_matmul_cpu(x_q, values, indices, n, m, in_features)


def nm_int8_matmul_cpu(
    x_q: torch.Tensor, values: torch.Tensor, indices: torch.Tensor, n: int, m: int, in_features: int
) -> torch.Tensor:
    """:func:`nm_int8_matmul`'s computation: the compiled kernel for few tokens on CPU,
    else unpack and ``_int_mm``."""
    if (
        x_q.device.type == "cpu"
        and x_q.shape[0] <= cpu_kernels.MAX_TOKENS
        and cpu_kernels.library() is not None
    ):
        return cpu_kernels.int8_matmul(x_q, values, indices, n, m, reference.index_bits(m))
    codes = unpack_nm(values, indices, n, m, in_features)
    return int8_matmul(x_q, codes)


@nm_int8_matmul.register_fake
def _nm_int8_matmul_fake(x_q, values, indices, n, m, in_features):  # noqa: ARG001
    return x_q.new_empty((x_q.shape[0], values.shape[0]), dtype=torch.int32)


def nm_linear_cpu(
    x: torch.Tensor,
    values: torch.Tensor,
    indices: torch.Tensor,
    n: int,
    m: int,
    in_features: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The CPU computation of :func:`nm_linear`, as a plain function (it trusts its arguments:
    a layer checks its shapes once, the op on every call). For at most
    ``cpu_kernels.MAX_TOKENS`` tokens the compiled kernel reads the packed weight (fp32
    accumulation, so equal to the reference to float rounding, not bit for bit); for more,
    the weight is unpacked (by the compiled kernel where there is one) and multiplied by
    torch."""
    tokens = x.numel() // in_features
    floats = cpu_kernels.FLOAT_KINDS
    if (
        tokens <= cpu_kernels.MAX_TOKENS
        and x.dtype in floats
        and values.dtype in floats
        and (bias is None or bias.dtype in floats)
        and cpu_kernels.library() is not None
    ):
        y = cpu_kernels.matmul(
            x.reshape(tokens, in_features), values, indices, n, m, reference.index_bits(m), bias
        )
        return y.reshape(*x.shape[:-1], values.shape[0])
    compute = gemm_dtype.compute_dtype(x)  # bf16 on a CPU that emulates it: float32
    weight = unpack_nm(values.to(compute), indices, n, m, in_features)
    y = F.linear(x.to(compute), weight, None if bias is None else bias.to(compute))
    return y.to(x.dtype)


def unpack_nm(
    values: torch.Tensor, indices: torch.Tensor, n: int, m: int, in_features: int
) -> torch.Tensor:
    """:func:`reference.unpack_nm`, by the compiled CPU kernel where it applies (the same
    tensor: unpacking is a copy)."""
    if (
        values.device.type == "cpu"
        and not torch.compiler.is_compiling()
        and values.element_size() in (1, 2, 4)
        and cpu_kernels.library() is not None
    ):
        return cpu_kernels.unpack(values, indices, n, m, reference.index_bits(m), in_features)
    return reference.unpack_nm(values, indices, n, m, in_features)


@nm_linear.register_kernel("cpu")
def _nm_linear_cpu(x, values, indices, n, m, in_features, bias=None):
    _check(x, values, n, m, in_features)
    return nm_linear_cpu(x, values, indices, n, m, in_features, bias)


@nm_linear.register_kernel("cuda")
def _nm_linear_cuda(x, values, indices, n, m, in_features, bias=None):
    """The Triton kernel (:mod:`lmcompress.kernels.nm_linear_triton`, imported on first use:
    CPU-only installs never import triton) for every layout it reads (``M <= 8``, fp16, bf16
    and fp32); the reference (unpack, then matmul) for the rest, and where triton is missing."""
    _check(x, values, n, m, in_features)
    kernel = _triton_kernel()
    floats = (torch.float16, torch.bfloat16, torch.float32)
    if kernel is None or m > kernel.MAX_M or x.dtype not in floats or values.dtype not in floats:
        return reference.nm_linear(x, values, indices, n, m, in_features, bias)
    return kernel.nm_linear_triton(x, values, indices, n, m, in_features, bias)


@functools.cache
def _triton_kernel():
    try:
        from lmcompress.kernels import nm_linear_triton
    except ImportError as err:
        logger.warning("nm_linear: no Triton kernel (%s); CUDA runs the reference", err)
        return None
    return nm_linear_triton


@nm_linear.register_fake
def _nm_linear_fake(x, values, indices, n, m, in_features, bias=None):  # noqa: ARG001
    _check(x, values, n, m, in_features)
    return x.new_empty((*x.shape[:-1], values.shape[0]))  # (..., out)


def _check(x: torch.Tensor, values: torch.Tensor, n: int, m: int, in_features: int) -> None:
    torch._check(
        x.shape[-1] == in_features,
        lambda: f"nm_linear: input has {x.shape[-1]} features, the layer {in_features}",
    )
    torch._check(
        values.dim() == 2 and values.shape[-1] == in_features // m * n,
        lambda: f"nm_linear: values {tuple(values.shape)} do not hold {n}:{m} of {in_features}",
    )


def _setup_context(ctx, inputs, output) -> None:  # noqa: ARG001
    x, values, indices, n, m, in_features, bias = inputs
    ctx.save_for_backward(x, values, indices)
    ctx.layout = (n, m, in_features)
    ctx.has_bias = bias is not None


def _backward(ctx, grad):
    """``y = x Wᵀ + b`` with ``W = unpack(values)``: ``dx = dy W``, ``db = Σ dy``, and
    ``dvalues`` = ``dW = dyᵀ x`` read at the stored positions (:func:`reference.gather_nm`)."""
    x, values, indices = ctx.saved_tensors
    n, m, in_features = ctx.layout
    grad_x = grad_values = grad_bias = None
    if ctx.needs_input_grad[0]:
        W = reference.unpack_nm(values, indices, n, m, in_features).to(grad.dtype)  # (out, in)
        grad_x = grad @ W  # (..., in)
    if ctx.needs_input_grad[1]:
        grad_2d = grad.reshape(-1, grad.shape[-1])  # (N, out)
        dW = grad_2d.t() @ x.reshape(-1, in_features).to(grad.dtype)  # (out, in)
        grad_values = reference.gather_nm(dW, indices, n, m).to(values.dtype)
    if ctx.has_bias and ctx.needs_input_grad[6]:
        grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0)
    return grad_x, grad_values, None, None, None, None, grad_bias


nm_linear.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("lmcompress::int4_linear", mutates_args=())
def int4_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor | None,
    zeros: torch.Tensor | None,
    bits: int,
    group_size: int,
    in_features: int,
    bias: torch.Tensor | None = None,
    indices: torch.Tensor | None = None,
    n: int = 1,
    m: int = 1,
    tiled: bool = False,
    scales16: torch.Tensor | None = None,
    zeros16: torch.Tensor | None = None,
    out_features: int = -1,
) -> torch.Tensor:
    """The int4 runtime's linear (:func:`lmcompress.kernels.int4_ops.linear`; ``indices``,
    ``n``, ``m``: packed N:M kept codes; ``tiled``: codes in ``int4_tiles``' layout, with the
    grid tiled ``scales16``, ``zeros16`` where given, ``scales``/``zeros`` then ``None`` and
    ``out_features`` the rows) as an op
    ``torch.compile`` keeps whole: a compiled graph calls the decode kernel for a few tokens,
    as eager mode does, instead of tracing the torch-op fallback (a dequantization of the
    whole weight each call). ``x (..., in)`` -> ``(..., out)`` in ``x``'s dtype."""
    nm = None if indices is None else (indices, n, m)
    return int4_ops.linear(
        x, qweight, scales, zeros, bits=bits, group_size=group_size, in_features=in_features,
        bias=bias, nm=nm, tiled=tiled, grid16=None if scales16 is None else (scales16, zeros16),
        out_features=out_features,
    )  # fmt: skip


@int4_linear.register_fake
def _int4_linear_fake(x, qweight, scales, zeros, bits, group_size, in_features, bias=None,  # noqa: ARG001
                      indices=None, n=1, m=1, tiled=False, scales16=None,  # noqa: ARG001
                      zeros16=None, out_features=-1):  # noqa: ARG001  # fmt: skip
    torch._check(x.shape[-1] == in_features, lambda: f"int4_linear: x {tuple(x.shape)}")
    out = scales.shape[0] if scales is not None else out_features
    return x.new_empty((*x.shape[:-1], out))
