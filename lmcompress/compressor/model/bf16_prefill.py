"""The plain linears of a loaded compressed model (the output head, expanded layers) computing
their bf16 prefill in float32, and their one-token decode by the compiled kernels, on a CPU that
emulates bf16 matmuls.

The compressed layers already do (:mod:`lmcompress.kernels.gemm_dtype`). What stays an
``nn.Linear`` in a bf16 export — SmolLM2's head, tied to the embeddings; every layer of the
``expanded`` runtime — would run torch's emulated bf16 matmul, 7-14× slower than float32 on an
AVX2 CPU: with the decoder's int4 layers in float32 and the head still bf16, the "int4 bf16"
row prefilled at 0.46× the fp32 dense row (one ad hoc ``benchmarks.speed`` run before this
module; 0.84× with it, ``benchmarks/results/speed_avx2/speed.md``).

:func:`install` turns each such layer into a :class:`Float32PrefillLinear` in place (its class
changed, nothing else: the same parameters, so a tied head stays tied, and the same state-dict
keys). From ``MIN_TOKENS`` tokens its matmul runs in float32 — the weight converted on each
call, 4 MiB of float32 output rows at a time (the int4 prefill's blocks), each block multiplied
while it is in cache and its product rounded to bf16 straight into the output's columns — and
below, at decode, the bf16 matmul reads half the bytes and stays. By blocks of 1,024-2,048 rows,
SmolLM2's head (49152 x 576) at 1,024 tokens took 410-439 ms against 555-563 converting the
whole weight and rounding the whole product after (the float32 matmul alone: 435-475; AVX2 EPYC,
2 threads, ad hoc): the converted weight and the float32 product never go through memory; the
int4 bf16 export's 4 x 256 prefill, 400 against 374 tokens/s (one process, 5 interleaved
rounds). The ``dense`` runtime gets it too, so that the runtimes of one export score the same
(its layers stay ``nn.Linear`` instances, what code written for plain transformers expects): a
packed 2:4 bf16 SmolLM2 scored 1203.65 against the dense runtime's plain bf16 1201.32 (4096
tokens of wiki-test; the test ``test_smollm2_2_4_packed_runtime_matches_dense…``), where torch's
emulated bf16 matmul and the float32 one round differently over 576-1536 inputs.

At one token (decode) such a layer runs the compiled kernels' dense float rows where their AVX2
loops are built (:func:`decode_linear`, :func:`decode_kernel`): the bf16 weight read once, four
rows a pass, products summed in float32 and rounded to bf16 once. Against torch's emulated bf16
``F.linear`` on a 2-core AMD EPYC, interleaved, ad hoc: 1.1-1.6× by shape (the comment above
``rows4_dense_float_avx2`` in ``cpu_kernels.cpp`` gives the timings); SmolLM2's head is memory
bound and gains least. Eager inference only: with a gradient wanted, or while
``torch.compile`` traces, torch's matmul stays.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from lmcompress.kernels import cpu_kernels, gemm_dtype, int4_ops, int4_reference

logger = logging.getLogger(__name__)

# From this many tokens the float32 matmul (weight converted) beats torch's bf16 one on an AVX2
# EPYC, 2 threads, 576x1536 and 1536x576 (ad hoc, µs): 8 tokens 1033 against 880, 16 tokens
# 977 against 1802, 32 tokens 1389 against 7923.
MIN_TOKENS = 16


class Float32PrefillLinear(nn.Linear):
    """``nn.Linear`` whose bf16 matmuls of ``MIN_TOKENS`` tokens or more run in float32 where
    :func:`gemm_dtype.compute_dtype` says so (module doc), and whose one-token bf16 matmul there
    runs :func:`decode_linear` where :func:`decode_kernel` applies; otherwise ``nn.Linear``'s."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.bfloat16 and gemm_dtype.compute_dtype(x) == torch.float32:
            if x.numel() >= MIN_TOKENS * self.in_features:
                return float32_linear(x, self.weight, self.bias)
            if x.numel() == self.in_features and decode_kernel(x, self.weight, self.bias):
                return decode_linear(x, self.weight, self.bias)
        return super().forward(x)


def decode_kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether :func:`decode_linear` computes this one-token linear: eager, no gradient wanted,
    and the compiled kernels' AVX2 loops there (measured on AVX2 only; module doc)."""
    if torch.compiler.is_compiling() or (
        torch.is_grad_enabled()
        and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
    ):
        return False
    return weight.dtype == torch.bfloat16 and _avx2_kernels()


@functools.cache
def _avx2_kernels() -> bool:
    lib = cpu_kernels.library()
    return lib is not None and lib.lmc_nm_simd() == 2


def decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` of one bf16 token ``x`` (..., in) by the compiled kernels' dense float rows
    (four rows a pass, the weight read once): float32 products summed in float32, rounded to
    bf16 once, as :func:`float32_linear` (torch's emulated bf16 matmul sums in another order)."""
    y = cpu_kernels.matmul(x.reshape(1, -1), weight, None, 0, 0, 0, bias)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def float32_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``F.linear`` of bf16 ``x`` (..., in) and ``weight`` (out, in) computed in float32, the
    weight converted by the int4 prefill's blocks of rows (``int4_ops.block_rows``), each
    block's product rounded into the bf16 output (..., out) by ``int4_reference.prefill_linear``:
    equal to ``F.linear(x.float(), weight.float(), bias.float()).bfloat16()`` (each output
    element the same float32 dot product, rounded once)."""
    out_features, in_features = weight.shape
    xf = x.reshape(-1, in_features).float()
    block = int4_ops.block_rows(in_features, torch.float32)
    y = int4_reference.prefill_linear(
        xf, out_features, block, lambda start, end: weight[start:end].float(), bias, x.dtype
    )
    return y.reshape(*x.shape[:-1], out_features)


def install(model: nn.Module) -> int:
    """Every plain bf16 ``nn.Linear`` of ``model`` on CPU made a :class:`Float32PrefillLinear`,
    where the CPU emulates bf16 matmuls (none elsewhere): how many."""
    if gemm_dtype.native_bf16():
        return 0
    changed = 0
    for module in model.modules():
        if (
            type(module) is nn.Linear
            and module.weight.dtype == torch.bfloat16
            and module.weight.device.type == "cpu"
        ):
            module.__class__ = Float32PrefillLinear
            changed += 1
    if changed:
        logger.debug("%d bf16 linears compute their prefill in float32 (no native bf16)", changed)
    return changed
