"""Packed 2:4 float weights on tiles of 16 rows: the layout of the CPU decode kernel
``lmc_nm24_tiled_float`` (:file:`cpu_kernels.cpp`, its section's comment).

The stored layout (:func:`lmcompress.kernels.reference.pack_nm`) keeps each row's kept values in
order and their 2-bit positions packed from the lowest bit, so a row's 32-bit position word
``k`` holds the 16 positions of its groups ``8k .. 8k + 7``. The row kernel gives each row a
vector and sums its lanes; on an AVX2 AMD EPYC it read 1B-shape layers at ~40 % of the memory
bandwidth, bound by its instructions (decoding positions, permuting across the vector). On
tiles a row is a lane:

- values ``(out, in / 2)``, tile ``b`` (rows ``16b .. 16b + 15``): for each group ``g`` the 16
  rows' first kept values, then their second ones;
- positions ``(out, in / 8)`` uint8: the rows' position words transposed by 16 rows (word ``k``
  of the 16 rows side by side).

Both are permutations of the stored tensors (the same shapes, dtypes and bytes), so a layer
holding tiles reads as many bytes per token; :func:`untile` gives the stored tensors back.
Tiles need ``in % 32 == 0`` and ``out % 16 == 0`` (:func:`tileable`).
"""

from __future__ import annotations

import torch

from lmcompress.kernels import cpu_kernels, ops

ROWS = 16  # rows a tile: one AVX-512 vector of fp32 lanes (AVX2: two)


def tileable(values: torch.Tensor, n: int, m: int, in_features: int) -> bool:
    """Whether a packed N:M layer's ``values`` (out, kept) can be held as tiles: 2:4, float,
    on CPU, ``in_features % 32 == 0`` and ``out % 16 == 0``."""
    return (
        (n, m) == (2, 4)
        and values.dtype in cpu_kernels.FLOAT_KINDS
        and values.device.type == "cpu"
        and in_features % 32 == 0
        and values.shape == (values.shape[0], in_features // 2)
        and values.shape[0] % ROWS == 0
    )


def tile(values: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The stored ``values`` (out, in / 2) and ``indices`` (out, in / 8) uint8 as tiles, each of
    its own shape and dtype (module doc)."""
    out, kept = values.shape
    tiled_values = values.reshape(out // ROWS, ROWS, kept // 2, 2).permute(0, 2, 3, 1)
    words = indices.reshape(out // ROWS, ROWS, -1, 4)  # a row's 32-bit words, as 4 bytes each
    return (
        tiled_values.reshape(out, kept).contiguous(),
        words.transpose(1, 2).reshape(indices.shape).contiguous(),
    )


def untile(
    tiled_values: torch.Tensor, tiled_indices: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`tile` undone: the stored ``(values, indices)``."""
    out, kept = tiled_values.shape
    values = tiled_values.reshape(out // ROWS, kept // 2, 2, ROWS).permute(0, 3, 1, 2)
    words = tiled_indices.reshape(out // ROWS, -1, ROWS, 4)
    indices = words.transpose(1, 2).reshape(tiled_indices.shape)
    return values.reshape(out, kept).contiguous(), indices.contiguous()


def applies(x: torch.Tensor, in_features: int) -> bool:
    """Whether the tiled kernel runs on ``x`` (..., in) eagerly: ``x``'s width is the layer's,
    and :func:`~lmcompress.kernels.ops.few_tokens_cpu` at ``cpu_kernels.MAX_TOKENS``."""
    return x.shape[-1] == in_features and ops.few_tokens_cpu(x, in_features, cpu_kernels.MAX_TOKENS)


def linear(
    x: torch.Tensor,
    tiled_values: torch.Tensor,
    tiled_indices: torch.Tensor,
    bias: torch.Tensor | None = None,
    vector: bool = True,
) -> torch.Tensor:
    """``x (..., in) @ Wᵀ + bias`` by the tiled kernel, in ``x``'s dtype (fp32 or bf16); the
    caller checks :func:`applies`. ``vector=False`` runs the plain loop (the same bits)."""
    in_features = tiled_values.shape[1] * 2
    out = tiled_values.shape[0]
    x = x.contiguous()
    y = x.new_empty((*x.shape[:-1], out))
    bias_ptr, bias_kind = (None, 0) if bias is None else (bias.data_ptr(), _kind(bias))
    cpu_kernels.library().lmc_nm24_tiled_float(
        x.data_ptr(), _kind(x), x.numel() // in_features, in_features, tiled_values.data_ptr(),
        _kind(tiled_values), tiled_indices.data_ptr(), out, bias_ptr, bias_kind, y.data_ptr(),
        _kind(y), int(vector), torch.get_num_threads(),
    )  # fmt: skip
    return y


def _kind(t: torch.Tensor) -> int:
    return cpu_kernels.FLOAT_KINDS[t.dtype]
