"""The lean decode step's pieces between the linears (``lmc_lean_*`` in :file:`cpu_kernels.cpp`).

A decode step of a Llama-family model in transformers runs ~50 small torch ops a layer around
its 7 linears (norms, rotary, the cache, attention, the MLP's activation): on a 2-core CPU at
SmolLM2's size they take most of the step, whatever the weights' format. These four calls do
the same work for one token, rounding to the model dtype where transformers' eager code does:

- :func:`rmsnorm`: ``LlamaRMSNorm``, with the residual add before it folded in (in place);
- :func:`rope_`: ``apply_rotary_pos_emb`` on q and k in place (bit-identical for one token);
- :func:`attend`: one query over the cached keys and values, GQA, in fp32 (as
  ``scaled_dot_product_attention`` accumulates; sums in another order);
- :func:`silu_mul`: ``act_fn(gate) * up``.

:mod:`lmcompress.compressor.lean_decode` strings them into a step. The functions trust
their arguments (contiguous CPU tensors of one float dtype, fp32 or bf16, one token) and
return new tensors or write in place where named with ``_``.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from lmcompress.kernels import cpu_kernels

_V, _I64, _INT, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
SIGNATURES = {
    "lmc_lean_rmsnorm": [_V, _V, _INT, _I64, _I64, _V, _INT, _F32, _V],
    "lmc_lean_rope": [_V, _I64, _V, _I64, _INT, _I64, _V, _V],
    "lmc_lean_attend": [_V, _INT, _I64, _I64, _I64, _V, _V, _INT, _I64, _I64, _I64, _F32, _V]
    + [_INT],
    "lmc_lean_silu_mul": [_V, _V, _INT, _I64, _V],
    # a block of tiled int4 layers in two calls (compressor/formats/int4_lean.py)
    "lmc_lean_int4_pre": [_V, _V, _V, _INT, _F32, _V, _V, _V, _INT],
    "lmc_lean_int4_post": [_V, _V, _V, _V, _V, _INT, _I64, _I64, _I64, _F32, _INT, _F32, _V]
    + [_INT],
    "lmc_lean_int4_stack": [_V, _I64, _I64, _V, _INT, _V, _V, _V, _INT],
}
KINDS = {torch.float32: 0, torch.bfloat16: 1}
MAX_HEAD_DIM = 1024  # the rotary helpers' stack rows


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels with these functions' signatures set; ``None`` where not built."""
    lib = cpu_kernels.library()
    if lib is None:
        return None
    for name, args in SIGNATURES.items():
        getattr(lib, name).argtypes = args
        getattr(lib, name).restype = None
    return lib


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, add: torch.Tensor | None = None
) -> torch.Tensor:
    """``weight * norm(x)`` over the last dim; first ``x += add`` in place where given."""
    y = torch.empty_like(x)
    rows = x.numel() // x.shape[-1]
    library().lmc_lean_rmsnorm(
        x.data_ptr(), None if add is None else add.data_ptr(), KINDS[x.dtype], rows, x.shape[-1],
        weight.data_ptr(), KINDS[weight.dtype], eps, y.data_ptr(),
    )  # fmt: skip
    return y


def rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotary embedding of one token's q (..., heads_q * hd) and k (..., heads_k * hd) in
    place; ``cos``, ``sin``: (hd,) of the token's position, in q's dtype."""
    hd = cos.shape[-1]
    library().lmc_lean_rope(
        q.data_ptr(), q.numel() // hd, k.data_ptr(), k.numel() // hd, KINDS[q.dtype], hd,
        cos.data_ptr(), sin.data_ptr(),
    )  # fmt: skip


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of one token's q (..., H * hd) over ``keys``, ``values`` (1, KVH, L, hd) with
    the same strides (a cache's tensors): (..., H * hd) in q's dtype."""
    if keys.stride() != values.stride():
        keys, values = keys.contiguous(), values.contiguous()
    _, kv_heads, length, hd = keys.shape
    heads = q.numel() // hd
    out = torch.empty_like(q)
    library().lmc_lean_attend(
        q.data_ptr(), KINDS[q.dtype], heads, kv_heads, hd, keys.data_ptr(), values.data_ptr(),
        KINDS[keys.dtype], length, keys.stride(1), keys.stride(2), scale, out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, silu rounded to the dtype first."""
    y = torch.empty_like(gate)
    library().lmc_lean_silu_mul(
        gate.data_ptr(), up.data_ptr(), KINDS[gate.dtype], gate.numel(), y.data_ptr()
    )
    return y
