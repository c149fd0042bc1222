"""Lean ops: the CPU layer computations a ``torch.compile`` graph holds whole.

Eager, a compressed layer calls its CPU kernel directly (:mod:`~lmcompress.kernels.cpu_kernels`).
While ``torch.compile`` traces, the kernel is opaque: without an op the graph would trace the
torch fallback instead (for int8: inductor's own quantize, ``torch._int_mm`` and rescale, which
at one token on a 1B-shape model decoded at 1.13× dense bf16 against eager's 2.47×,
``results/speed_scale.md`` before this module). Each op here is the eager computation itself,
so a compiled graph computes what eager does, bit for bit:

- ``int4_decode``: a tiled int4 layer for a few tokens (:func:`int4_tiles.try_decode`, else
  :func:`int4_ops.linear`);
- ``int8_layer``: a W8A8 layer from float activations, dense or packed N:M codes, any number of
  tokens: the fused few-token kernel, else the one-pass activation quantization, the integer
  products and the rescale by column blocks (:func:`int8_ops.linear`);
- ``low_rank_layer``: ``(x Aᵀ) Bᵀ + b`` by the low-rank kernel for a few tokens
  (:func:`ops.low_rank_linear`);
- ``nm24_decode``: a packed 2:4 float layer held as :mod:`nm24_tiles`' tiles, by the tiled
  kernel for a few tokens (else untiled, :func:`ops.nm_linear_cpu`).

They are ``torch.library.Library`` ops, not ``custom_op`` (whose Python wrappers cost ~7 µs a
call against ~1.5 here; a SmolLM2 step makes 121 to 211 layer calls, each 5-25 µs of
arithmetic at one token). Only a graph traced without gradients holds them (:func:`traced_cpu`),
so they have no autograd formula; a fake implementation gives shapes and dtypes.
"""

from __future__ import annotations

import torch

from lmcompress.kernels import cpu_kernels, int4_ops, int4_tiles, int8_ops, nm24_tiles, ops

_LIB = torch.library.Library("lmcompress", "FRAGMENT")
_LIB.define(
    "int4_decode(Tensor x, Tensor tiles, Tensor scales16, Tensor zeros16, Tensor? bias, "
    "int bits, int group_size, int out_features) -> Tensor"
)
_LIB.define(
    "int8_layer(Tensor x, Tensor codes, Tensor weight_scale, Tensor? input_scale, Tensor? bias, "
    "Tensor? indices, int n, int m, int in_features) -> Tensor"
)
_LIB.define("low_rank_layer(Tensor x, Tensor A, Tensor B, Tensor? bias) -> Tensor")
_LIB.define("nm24_decode(Tensor x, Tensor values, Tensor indices, Tensor? bias) -> Tensor")


def traced_cpu(x: torch.Tensor, in_features: int, max_tokens: int | None = None) -> bool:
    """While ``torch.compile`` traces (``x`` a fake tensor of the graph's shape): whether a layer
    of ``in_features`` inputs may put its lean op in the graph for ``x`` — on CPU, fp32 or bf16,
    no gradient, at most ``max_tokens`` rows where given, and the kernels built."""
    return (
        torch.compiler.is_compiling()
        and x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)
        and x.shape[-1] == in_features
        and (max_tokens is None or x.numel() <= max_tokens * in_features)
        and not (x.requires_grad and torch.is_grad_enabled())
        and cpu_kernels.built()
    )


def int4_decode(x, tiles, scales16, zeros16, bias, bits, group_size, out_features):
    """A tiled int4 layer's linear (:mod:`~lmcompress.kernels.int4_tiles`' layout) for a few
    tokens: the decode kernel on the shortest path (:func:`int4_tiles.try_decode`), else
    :func:`int4_ops.linear` (bit for bit what eager runs). ``x (..., in)`` ->
    ``(..., out_features)`` in ``x``'s dtype."""
    return torch.ops.lmcompress.int4_decode.default(
        x, tiles, scales16, zeros16, bias, bits, group_size, out_features
    )


def _int4_decode_impl(x, tiles, scales16, zeros16, bias, bits, group_size, out_features):
    buffers = {"qweight": tiles, "scales16": scales16, "zeros16": zeros16, "bias": bias}
    y = int4_tiles.try_decode(x, buffers, x.shape[-1], out_features)
    if y is not None:
        return y
    return int4_ops.linear(
        x, tiles, None, None, bits=bits, group_size=group_size, in_features=x.shape[-1],
        bias=bias, tiled=True, grid16=(scales16, zeros16), out_features=out_features,
    )  # fmt: skip


def int8_layer(x, codes, weight_scale, input_scale, bias, nm=None, in_features=None):
    """A W8A8 layer on CPU (``lmcompress.compressor.formats.int8.int8_forward``'s ``int`` path):
    ``x`` (..., in) fp32 or bf16; ``codes`` int8 (out, in), or the packed N:M codes with
    ``nm = (indices, n, m)`` (then per-channel ``weight_scale`` only, and ``in_features``);
    ``input_scale`` (1,) or ``None`` for per-token scales. ``(..., out)`` in ``x``'s dtype."""
    indices, n, m = nm if nm is not None else (None, 1, 1)
    return torch.ops.lmcompress.int8_layer.default(
        x, codes, weight_scale, input_scale, bias, indices, n, m, in_features or x.shape[-1]
    )


def _int8_layer_impl(x, codes, weight_scale, input_scale, bias, indices, n, m, in_features):
    if cpu_kernels.library() is None:
        raise RuntimeError("lmcompress::int8_layer needs the compiled CPU kernels")
    x_2d = x.reshape(-1, in_features)
    per_channel = weight_scale.shape[1] == 1
    if x_2d.shape[0] <= cpu_kernels.MAX_TOKENS and per_channel:  # one fused pass
        y = cpu_kernels.int8_linear(x_2d, weight_scale, input_scale, bias, codes, indices, n, m)
    else:
        x_q, x_scale = cpu_kernels.int8_quantize(x_2d, input_scale)
        if indices is None:
            y = int8_ops.linear(x_q, x_scale, codes, weight_scale, bias, x.dtype)
        else:
            acc = ops.nm_int8_matmul_cpu(x_q, codes, indices, n, m, in_features)
            y = int8_ops.rescale(acc, x_scale, weight_scale, bias, x.dtype)
    return y.reshape(*x.shape[:-1], weight_scale.shape[0])


def low_rank_layer(x, A, B, bias):
    """``(x Aᵀ) Bᵀ + bias`` (:func:`ops.low_rank_linear`) as one op; ``(..., out)``."""
    return torch.ops.lmcompress.low_rank_layer.default(x, A, B, bias)


def _low_rank_layer_impl(x, A, B, bias):
    return ops.low_rank_linear(x, A, B, bias)


def nm24_decode(x, values, indices, bias):
    """A tiled 2:4 float layer (``values``, ``indices``: :func:`nm24_tiles.tile`'s) as one op."""
    return torch.ops.lmcompress.nm24_decode.default(x, values, indices, bias)


def _nm24_decode_impl(x, values, indices, bias):
    if nm24_tiles.applies(x, values.shape[1] * 2):
        return nm24_tiles.linear(x, values, indices, bias)
    stored = nm24_tiles.untile(values, indices)
    return ops.nm_linear_cpu(x, *stored, 2, 4, values.shape[1] * 2, bias)


_LIB.impl("int4_decode", _int4_decode_impl, "CompositeExplicitAutograd")
_LIB.impl("nm24_decode", _nm24_decode_impl, "CompositeExplicitAutograd")
_LIB.impl("int8_layer", _int8_layer_impl, "CompositeExplicitAutograd")
_LIB.impl("low_rank_layer", _low_rank_layer_impl, "CompositeExplicitAutograd")


@torch.library.register_fake("lmcompress::int4_decode")
def _int4_decode_fake(x, tiles, scales16, zeros16, bias, bits, group_size, out_features):  # noqa: ARG001  # fmt: skip
    return x.new_empty((*x.shape[:-1], out_features))


@torch.library.register_fake("lmcompress::int8_layer")
def _int8_layer_fake(x, codes, weight_scale, input_scale, bias, indices, n, m, in_features):  # noqa: ARG001  # fmt: skip
    return x.new_empty((*x.shape[:-1], weight_scale.shape[0]))


@torch.library.register_fake("lmcompress::low_rank_layer")
def _low_rank_layer_fake(x, A, B, bias):  # noqa: ARG001
    return x.new_empty((*x.shape[:-1], B.shape[0]))


@torch.library.register_fake("lmcompress::nm24_decode")
def _nm24_decode_fake(x, values, indices, bias):  # noqa: ARG001
    return x.new_empty((*x.shape[:-1], values.shape[0]))
