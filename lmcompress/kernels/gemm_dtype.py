"""The dtype a CPU matmul of bf16 operands is computed in: bf16 where the CPU multiplies bf16
natively, float32 where torch would emulate it.

On an x86 CPU without AVX-512 BF16 or AMX-BF16, torch's bf16 ``F.linear`` runs far below its
fp32 one: AMD EPYC (Zen 3: avx2, fma, f16c; no AVX-512), 2 threads, 1024 tokens × 576 inputs ×
1536 outputs (ad hoc, median of 5): bf16 147.5 ms, fp32 21.9 ms, and 10.8 ms for the bf16
operands converted to fp32, multiplied, the product rounded back to bf16. On that host every
bf16 row of ``benchmarks.speed`` prefilled at 0.13-0.16× the fp32 dense row before this module
(dense bf16 still does: 0.15× in ``benchmarks/results/speed_avx2/speed.md``; the compressed bf16
rows 0.84-1.04× with it). With AVX-512 BF16 or AMX the bf16 matmul is the faster one (Intel Xeon
with AMX: dense bf16 prefill 3.2× dense fp32, ``benchmarks/results/speed_xeon``).

:func:`compute_dtype` is what the compressed layers' prefill (a weight dequantized or expanded
by blocks, then torch's matmul) computes in: float32 for bf16 activations on such a CPU — the
weight dequantized straight into float32, the activations converted, the product rounded to
bf16 once — otherwise the activations' own dtype. It never changes a layer's output dtype.
Float32 products are at least as accurate as bf16 ones (bf16 ``F.linear`` accumulates in
float32 and rounds the result; here the dequantized weight is not rounded to bf16 first), so
outputs move by bf16 rounding, not more.

``LMCOMPRESS_BF16_GEMM`` (``native`` or ``float32``) overrides the CPU flags, for a measurement
of both choices on one host; it is read when a process first asks.
"""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

import torch

# The x86 flags (as /proc/cpuinfo names them) that mean a native bf16 dot product.
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
_X86 = ("x86_64", "amd64", "i386", "i686")


def native_bf16_from(machine: str, cpuinfo: str | None, override: str | None) -> bool:
    """Whether bf16 matmuls run in bf16, from the machine name (``platform.machine()``), the
    text of ``/proc/cpuinfo`` (``None`` where unreadable) and the ``LMCOMPRESS_BF16_GEMM``
    value. Only x86 CPUs whose flags lack every one of :data:`NATIVE_BF16_FLAGS` compute in
    float32; elsewhere (ARM, an unreadable cpuinfo) torch's bf16 matmul is left as it is."""
    if override:
        if override not in ("native", "float32"):
            raise ValueError(f"LMCOMPRESS_BF16_GEMM={override!r}: expected native or float32")
        return override == "native"
    if machine.lower() not in _X86 or cpuinfo is None:
        return True
    flags = next((ln.split(":", 1)[1].split() for ln in cpuinfo.splitlines()
                  if ln.startswith("flags") and ":" in ln), None)  # fmt: skip
    return flags is None or any(flag in flags for flag in NATIVE_BF16_FLAGS)


@functools.cache
def _native_bf16() -> bool:
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = None
    override = os.environ.get("LMCOMPRESS_BF16_GEMM")
    return native_bf16_from(platform.machine(), cpuinfo, override)


@torch.compiler.assume_constant_result  # called while torch.compile traces, not traced
def native_bf16() -> bool:
    """This process's answer of :func:`native_bf16_from` (read once)."""
    return _native_bf16()


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul with ``x``'s activations is computed in (module doc): float32 for bf16
    on a CPU without a native bf16 dot product, else ``x``'s dtype (float32 for integer ``x``)."""
    if not x.dtype.is_floating_point:
        return torch.float32
    if x.dtype == torch.bfloat16 and x.device.type == "cpu" and not native_bf16():
        return torch.float32
    return x.dtype
