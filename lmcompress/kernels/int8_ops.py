"""``torch.ops.lmcompress.int8_linear``: the W8A8 linear on integer hardware paths.

``y = (x_q @ w_qᵀ) · x_scale · w_scaleᵀ + bias``, with the product of the int8 codes taken by
:func:`torch._int_mm` (int8 × int8 → int32, exact: |acc| ≤ 128² · in < 2³¹ for in < 131072),
then one float32 rescale. Registered with ``torch.library.custom_op`` and a fake
implementation, so ``torch.compile(fullgraph=True)`` traces it; the same op name can take a
device kernel later (``register_kernel("cuda")``). The int8 layers call its body,
:func:`linear`, directly (no dispatch cost, and fusible by ``torch.compile``).

``torch._int_mm`` is 2-D only (callers flatten the token dimensions). On CPU (torch 2.13) it
takes any shape, measured from 1×5×3 up; on CUDA it needs more than 16 rows and inner and
outer sizes that are multiples of 8, so :func:`int8_matmul` pads with zero codes there (zeros
add nothing to an integer sum: the result is unchanged).

On a CPU with AVX2 but not AVX-512 torch's ``_int_mm`` has no fast path (an AMD EPYC Zen 3: ~18×
slower than the compiled kernel at 256 tokens): there :func:`int8_matmul` takes the same exact
products from ``cpu_kernels.int8_matmul_dense`` (``cpu_kernels.products_beat_int_mm``).

Group-wise weight scales (``w_scale`` (out, groups)) cannot be applied after one ``_int_mm``:
each group's partial sum needs its own scale. They run as one ``_int_mm`` per group of input
channels, each rescaled by its group's scale and summed in float32 — exact per group, but the
float32 sum over groups rounds, so grouped results agree with the simulated path only to float32
rounding (per-channel results agree to the rounding of the final rescale).

No ``from __future__ import annotations`` here: ``custom_op`` reads the schema from the
annotations.
"""

import torch
import torch.nn.functional as F

from lmcompress.kernels import cpu_kernels


def linear(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The computation of :func:`int8_linear`, as a plain function: what the int8 layers call.

    The custom op's Python dispatch costs ~30 µs a call on CPU, more than ``_int_mm`` itself at
    one token (~8 µs for 576 × 576, measured, torch 2.13): at batch-1 decoding over 210 layers
    that was ~8 ms of a ~32 ms token. Called directly, the same torch ops are also what
    ``torch.compile`` fuses: the activation quantization before ``_int_mm`` and the rescale and
    bias after it become one generated loop each. It trusts its arguments (a layer checks its
    shapes once, when it is built); the op checks them on every call."""
    if w_scale.shape[1] == 1:
        if _cpu_rescale(x_q, x_scale, w_scale, bias, out_dtype):
            return _column_blocks(x_q, x_scale, w_q, w_scale, bias, out_dtype)
        return rescale(int8_matmul(x_q, w_q), x_scale, w_scale, bias, out_dtype)
    y = _per_group(x_q, w_q, w_scale.float()).mul_(x_scale.float())
    if bias is not None:
        y.add_(bias.float())
    return y.to(out_dtype)


def rescale(
    acc: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``acc · x_scale · w_scaleᵀ + bias`` in float32, cast to ``out_dtype``: the float half of
    a per-channel int8 linear, for the int32 products ``acc`` (tokens, out) of any integer
    matmul (``_int_mm``, or the packed N:M kernel: the same integers give the same output)."""
    if _cpu_rescale(acc, x_scale, w_scale, bias, out_dtype):  # one pass instead of three
        return cpu_kernels.int8_rescale(acc, x_scale, w_scale, bias, out_dtype)
    x_scale, w_scale = x_scale.float(), w_scale.float()
    y = torch.mul(acc, x_scale)  # int32 · fp32 -> fp32 (tokens, out)
    if bias is None:
        y.mul_(w_scale.t())  # (1, out)
    else:  # bias + y · w_scale in one pass over the output (memory-bound on CPU)
        torch.addcmul(bias.float(), y, w_scale.t(), out=y)
    return y.to(out_dtype)


def _cpu_rescale(
    acc: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> bool:
    """Whether the compiled CPU rescale (bit-identical to :func:`rescale`'s torch ops) applies:
    on CPU, not while compiling (inductor fuses the torch ops), float32 scales and no gradient
    through them, an fp32 or bf16 output, and the kernels built."""
    return (
        acc.device.type == "cpu"
        and not torch.compiler.is_compiling()
        and out_dtype in (torch.float32, torch.bfloat16)
        and x_scale.dtype == w_scale.dtype == torch.float32
        and (bias is None or bias.dtype in cpu_kernels.FLOAT_KINDS)
        and not (torch.is_grad_enabled() and (x_scale.requires_grad or w_scale.requires_grad))
        and cpu_kernels.library() is not None
    )


BLOCK_BYTES = 4 << 20  # int32 products per column block (measured on SmolLM2's lm_head)


def _column_blocks(x_q, x_scale, w_q, w_scale, bias, out_dtype) -> torch.Tensor:
    """:func:`linear` on CPU by blocks of output columns, each block's int32 products
    (``BLOCK_BYTES``) rescaled into the output while they are still in cache: one pass over
    the output instead of writing and reading back all the products (the lm_head's are 200 MB
    at 1,024 tokens). The same integers and rescale, so the same output bit for bit."""
    tokens, out_features = x_q.shape[0], w_q.shape[0]
    block = max(64, BLOCK_BYTES // (4 * tokens) // 64 * 64)
    if block >= out_features:
        return cpu_kernels.int8_rescale(int8_matmul(x_q, w_q), x_scale, w_scale, bias, out_dtype)
    y = torch.empty((tokens, out_features), dtype=out_dtype)
    for start in range(0, out_features, block):
        end = min(start + block, out_features)
        acc = int8_matmul(x_q, w_q[start:end])
        part = None if bias is None else bias[start:end]
        cpu_kernels.int8_rescale(acc, x_scale, w_scale[start:end], part, out_dtype, y[:, start:end])
    return y


@torch.library.custom_op("lmcompress::int8_linear", mutates_args=())
def int8_linear(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``x_q`` int8 (tokens, in), ``x_scale`` fp32 (tokens, 1) or (1,), ``w_q`` int8 (out, in),
    ``w_scale`` fp32 (out, 1) or (out, groups), ``bias`` (out,) or ``None``; returns
    (tokens, out) in ``out_dtype`` (the rescale and the bias are computed in float32).
    The op (for callers that want one opaque node, or a device kernel under the same name);
    its CPU computation is :func:`linear`."""
    _check(x_q, x_scale, w_q, w_scale)
    return linear(x_q, x_scale, w_q, w_scale, bias, out_dtype)


def _per_group(x_q: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """``Σ_g (x_q[:, g] @ w_q[:, g]ᵀ) · w_scale[:, g]`` over groups of input channels, fp32."""
    groups = w_scale.shape[1]
    group_size = w_q.shape[1] // groups
    y = x_q.new_zeros((x_q.shape[0], w_q.shape[0]), dtype=torch.float32)  # (tokens, out)
    for g in range(groups):
        cols = slice(g * group_size, (g + 1) * group_size)
        y.add_(int8_matmul(x_q[:, cols], w_q[:, cols]) * w_scale[:, g])  # (tokens, out)
    return y


@int8_linear.register_fake
def _int8_linear_fake(x_q, x_scale, w_q, w_scale, bias, out_dtype):  # noqa: ARG001
    _check(x_q, x_scale, w_q, w_scale)
    return x_q.new_empty((x_q.shape[0], w_q.shape[0]), dtype=out_dtype)


def int8_matmul(x_q: torch.Tensor, w_q: torch.Tensor, pad: bool | None = None) -> torch.Tensor:
    """``x_q @ w_qᵀ`` for int8 ``x_q`` (tokens, in) and ``w_q`` (out, in), as exact int32.

    ``pad`` (default: on CUDA only) zero-pads to ``_int_mm``'s CUDA constraints (rows > 16,
    inner and outer sizes multiples of 8) and crops the result.
    """
    if pad is None:
        pad = x_q.device.type == "cuda"
    if (
        not pad
        and x_q.device.type == "cpu"
        and not torch.compiler.is_compiling()
        and cpu_kernels.products_beat_int_mm()
    ):  # the same integers, without torch's slow int8 GEMM on this CPU
        return cpu_kernels.int8_matmul_dense(x_q, w_q)
    if not pad:
        return torch._int_mm(x_q, w_q.t())
    tokens, in_features = x_q.shape
    out_features = w_q.shape[0]
    rows = max(17, tokens)
    rows, inner, cols = (-(-n // 8) * 8 for n in (rows, in_features, out_features))
    x_p = F.pad(x_q, (0, inner - in_features, 0, rows - tokens))
    w_p = F.pad(w_q, (0, inner - in_features, 0, cols - out_features))
    return torch._int_mm(x_p, w_p.t())[:tokens, :out_features]


def _check(
    x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor
) -> None:
    torch._check(
        x_q.dtype == torch.int8 and w_q.dtype == torch.int8,
        lambda: f"int8_linear: codes must be int8, got {x_q.dtype} and {w_q.dtype}",
    )
    torch._check(
        x_q.dim() == 2 and w_q.dim() == 2 and x_q.shape[1] == w_q.shape[1],
        lambda: f"int8_linear: x {tuple(x_q.shape)} and weight {tuple(w_q.shape)} do not match",
    )
    torch._check(
        w_scale.dim() == 2
        and w_scale.shape[0] == w_q.shape[0]
        and w_q.shape[1] % w_scale.shape[1] == 0,
        lambda: f"int8_linear: weight scale {tuple(w_scale.shape)} for weight {tuple(w_q.shape)}",
    )
    torch._check(
        x_scale.numel() == 1 or tuple(x_scale.shape) == (x_q.shape[0], 1),
        lambda: f"int8_linear: activation scale {tuple(x_scale.shape)} for x {tuple(x_q.shape)}",
    )
