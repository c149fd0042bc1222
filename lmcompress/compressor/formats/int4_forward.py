"""A tiled :class:`~lmcompress.compressor.formats.int4.Int4Linear`'s decode: the shortest path
from the module to :mod:`~lmcompress.kernels.int4_tiles`' kernel, eager or compiled.

Eager, the kernel is called directly (``int4_tiles.try_decode``), once for the siblings that
share an input (:mod:`~lmcompress.compressor.formats.int4_shared`). While ``torch.compile``
traces, the graph holds the lean ``lmcompress::int4_decode`` op on the layer's own tensors
instead of the general ``int4_linear`` (~12 µs less a call). Siblings are not merged in a
graph: common-subexpression elimination does not merge the op's calls, and the shared
tensors add guards that dynamo checks before every step (ad hoc on SmolLM2 at one token: a
compiled step took ~2 ms longer with them). Outputs are eager's bit for bit.
"""

from __future__ import annotations

import torch
from torch import nn

from lmcompress.kernels import int4_tiles, int4_tiles24, lean_ops


def tiled_forward(layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """``layer``'s output for ``x`` by the decode kernel (module doc), ``None`` where it does
    not apply (more tokens, another dtype or device, a gradient needed): the caller then takes
    the general path."""
    packed = "n" in layer.__dict__  # packed 2:4 tiles (int4_tiles24); compiled: the general op
    if not torch.compiler.is_compiling():
        shared = layer.__dict__.get("shared_input")
        if shared is not None:
            return shared[0].forward(layer, shared[1], x)
        decode = int4_tiles24.try_decode if packed else int4_tiles.try_decode
        return decode(x, layer._buffers, layer.in_features, layer.out_features)
    if packed:
        return None
    if (x.requires_grad and torch.is_grad_enabled()) or not int4_tiles.traced_decode_applies(
        x, layer.in_features
    ):
        return None
    held = layer._buffers
    return lean_ops.int4_decode(
        x, held["qweight"], held["scales16"], held["zeros16"], held["bias"], layer.bits,
        layer.group_size, layer.out_features,
    )  # fmt: skip


def hold_tiles24(layer: nn.Module) -> None:
    """Hold a packed 2:4 int4 layer's codes and positions in :mod:`~lmcompress.kernels.
    int4_tiles24`' layout (``qweight`` its tiles, ``indices`` its patterns; the grid tiled as
    ``scales16``, ``zeros16``) where :func:`~lmcompress.kernels.int4_tiles24.tileable`; else
    they stay as stored."""
    if layer.tiled or not int4_tiles24.tileable(
        layer.qweight, layer.n, layer.m, layer.bits, layer.group_size, layer.in_features
    ):
        return
    tiled = int4_tiles24.tile(layer.qweight, layer.indices, layer.in_features)
    if tiled is not None:
        layer.qweight, layer.indices = tiled
        layer.hold_grid_tiled()


def stored_nm(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed N:M int4 layer's (``qweight``, ``indices``) in the stored layout."""
    if layer.tiled:
        return int4_tiles24.untile(layer.qweight, layer.indices, layer.out_features)
    return layer.qweight, layer.indices
