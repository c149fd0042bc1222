"""``torch.ops.lmcompress.int8_softmax``: a row softmax that writes 8-bit probabilities and their
bias-corrected dequantization (issue 11, the softmax bias correction's deployment form).

Its definition, with the exact arithmetic, and its CPU implementation is
:func:`lmcompress.kernels.reference.int8_softmax_reference`; on CUDA it runs the Triton kernel
(:mod:`lmcompress.kernels.triton_softmax`), equal to it bit for bit: in Triton's interpreter
(tests/kernels/test_int8_softmax_kernel.py); on CUDA by the same argument, not yet run on a GPU.
The op has no autograd formula (rounding has no useful gradient).

This file has no ``from __future__ import annotations``: ``custom_op`` reads the real annotations.
"""

import torch

from lmcompress.errors import ConfigError
from lmcompress.kernels.reference import (
    as_4d,
    as_additive,
    check_int8_softmax,
    int8_softmax_reference,
    offset_2d,
)
from lmcompress.kernels.softmax_constants import BLOCK, DEFAULT_SCALE


@torch.library.custom_op("lmcompress::int8_softmax", mutates_args=())
def int8_softmax(
    scores: torch.Tensor,
    mask: torch.Tensor | None = None,
    offset: torch.Tensor | None = None,
    scale: float = DEFAULT_SCALE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """8-bit softmax over the last dimension: ``(q uint8, out float32)`` (module doc).

    CPU and any device without a kernel: :func:`int8_softmax_reference`; CUDA: the Triton kernel
    (:func:`int8_softmax_triton`), equal to it bit for bit.
    """
    return int8_softmax_reference(scores, mask, offset, scale)


@int8_softmax.register_fake
def _int8_softmax_fake(scores, mask=None, offset=None, scale=DEFAULT_SCALE):
    check_int8_softmax(scores, mask, offset, scale)
    return scores.new_empty(scores.shape, dtype=torch.uint8), scores.new_empty(
        scores.shape, dtype=torch.float32
    )


@int8_softmax.register_kernel("cuda")
def _int8_softmax_cuda(scores, mask=None, offset=None, scale=DEFAULT_SCALE):
    return int8_softmax_triton(scores, mask, offset, scale)


def int8_softmax_triton(
    scores: torch.Tensor,
    mask: torch.Tensor | None = None,
    offset: torch.Tensor | None = None,
    scale: float = DEFAULT_SCALE,
    rows_per_program: int = 16,
    values: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the Triton kernel (CUDA tensors, or CPU tensors when ``TRITON_INTERPRET=1`` was set
    before :mod:`lmcompress.kernels.triton_softmax` was first imported). Same contract as
    :func:`int8_softmax_reference`; ``values``, a contiguous float32 tensor shaped like
    ``scores``, receives ``v = p / scale`` before rounding (for tests)."""
    from lmcompress.kernels.triton_softmax import int8_softmax_kernel  # imports triton

    check_int8_softmax(scores, mask, offset, scale)
    if rows_per_program < 1 or rows_per_program & (rows_per_program - 1):
        raise ConfigError(f"rows_per_program must be a power of two, got {rows_per_program}")
    s4 = as_4d(scores)  # (B, H, Tq, Tk), a view
    batch, heads, queries, keys = s4.shape
    n_rows = batch * heads * queries
    q = torch.empty(s4.shape, dtype=torch.uint8, device=scores.device)
    out = torch.empty(s4.shape, dtype=torch.float32, device=scores.device)
    if n_rows == 0 or keys == 0:
        return q.view(scores.shape), out.view(scores.shape)
    m4 = None if mask is None else as_4d(as_additive(mask).expand(scores.shape))
    off = None if offset is None else offset_2d(offset, scores, s4.shape)  # (B, H) view
    grid = (-(-n_rows // rows_per_program),)
    int8_softmax_kernel[grid](
        s4,
        s4 if m4 is None else m4,  # a placeholder pointer when there is no mask
        s4 if off is None else off,
        q,
        out,
        n_rows,
        keys,
        heads,
        queries,
        *s4.stride(),
        *(m4.stride() if m4 is not None else (0, 0, 0, 0)),
        *(off.stride() if off is not None else (0, 0)),
        float(scale),
        q if values is None else values,  # placeholder pointer when not stored
        HAS_MASK=m4 is not None,
        HAS_OFFSET=off is not None,
        ROWS=rows_per_program,
        BLOCK_COLS=BLOCK,
        STORE_V=values is not None,
        enable_fp_fusion=False,  # no FMA contraction: each op rounds as in the reference
    )
    return q.view(scores.shape), out.view(scores.shape)
