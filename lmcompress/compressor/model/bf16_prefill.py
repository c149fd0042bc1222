"""The plain linears of a loaded compressed model (the output head, expanded layers) computing
their bf16 prefill in float32 on a CPU that emulates bf16 matmuls.

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
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from lmcompress.kernels import gemm_dtype, int4_ops, int4_reference

logger = logging.getLogger(__name__)

# From this many tokens the float32 matmul (weight converted) beats torch's bf16 one on an AVX2
# EPYC, 2 threads, 576x1536 and 1536x576 (ad hoc, µs): 8 tokens 1033 against 880, 16 tokens
# 977 against 1802, 32 tokens 1389 against 7923.
MIN_TOKENS = 16


class Float32PrefillLinear(nn.Linear):
    """``nn.Linear`` whose bf16 matmuls of ``MIN_TOKENS`` tokens or more run in float32 where
    :func:`gemm_dtype.compute_dtype` says so (module doc); otherwise ``nn.Linear``'s."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            x.dtype == torch.bfloat16
            and x.numel() >= MIN_TOKENS * self.in_features
            and gemm_dtype.compute_dtype(x) == torch.float32
        ):
            return float32_linear(x, self.weight, self.bias)
        return super().forward(x)


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
