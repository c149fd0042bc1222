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

from lmcompress.kernels import int4_tiles, lean_ops


def tiled_forward(layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """``layer``'s output for ``x`` by the decode kernel (module doc), ``None`` where it does
    not apply (more tokens, another dtype or device, a gradient needed): the caller then takes
    the general path."""
    if not torch.compiler.is_compiling():
        shared = layer.__dict__.get("shared_input")
        if shared is not None:
            return shared[0].forward(layer, shared[1], x)
        return int4_tiles.try_decode(x, layer._buffers, layer.in_features, layer.out_features)
    if (x.requires_grad and torch.is_grad_enabled()) or not int4_tiles.traced_decode_applies(
        x, layer.in_features
    ):
        return None
    held = layer._buffers
    return lean_ops.int4_decode(
        x, held["qweight"], held["scales16"], held["zeros16"], held["bias"], layer.bits,
        layer.group_size, layer.out_features,
    )  # fmt: skip
