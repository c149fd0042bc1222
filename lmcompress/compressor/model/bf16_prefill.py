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
keys). From ``MIN_TOKENS`` tokens its matmul runs in float32 — the weight converted on each call,
which at prefill costs little beside the matmul — and the product is rounded to bf16 once;
below, at decode, the bf16 matmul reads half the bytes and stays. The ``dense`` runtime gets it
too, so that the runtimes of one export score the same (its layers stay ``nn.Linear``
instances, what code written for plain transformers expects): a packed 2:4 bf16 SmolLM2 scored
1203.65 against the dense runtime's plain bf16 1201.32 (4096 tokens of wiki-test; the test
``test_smollm2_2_4_packed_runtime_matches_dense…``), where torch's emulated bf16 matmul and the
float32 one round differently over 576-1536 inputs.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from lmcompress.kernels import gemm_dtype

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
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)
        return super().forward(x)


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
