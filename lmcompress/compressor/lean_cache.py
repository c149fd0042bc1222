"""Keys and values that grow in place: the KV layout of the lean decode step's one-call stack.

transformers' ``DynamicCache`` grows each layer's keys and values by ``torch.cat`` at every
token: a new tensor and a copy of the whole cache, ~30 µs a layer for one token at SmolLM2's size
on a 2-core CPU, and a Python call between every two kernels. :class:`GrowingKV` keeps each
layer's keys and values in buffers with room for more tokens and hands the cache *views* of
their first L positions, so that a compiled call can write the next token's k and v in place
(:func:`lmcompress.compressor.formats.int4_lean.run_stack`) and Python only moves the views on.

The cache stays transformers' own: its layers hold ordinary tensors (views), any other code may
read them, and where anything else changed the cache since the last step (transformers' forward
appending by ``torch.cat``, ``crop``, a reorder) its layers no longer hold these views:
:meth:`GrowingKV.length` says so and :meth:`GrowingKV.adopt` copies the cache into new buffers.
"""

from __future__ import annotations

from typing import Any

import torch

STEP = 256  # buffers grow by at least this many positions (and a quarter of what they hold)


def usable(cache: Any, dtype: torch.dtype) -> int | None:
    """The common length L of ``cache``'s layers where it can move into :class:`GrowingKV`
    buffers: plain ``DynamicLayer`` layers (no sliding window), started, batch 1, on the CPU,
    keys and values of ``dtype`` and one shape; else ``None``."""
    layers = getattr(cache, "layers", None)
    if not layers:
        return None
    lengths = set()
    for layer in layers:
        if type(layer).__name__ != "DynamicLayer" or not layer.is_initialized:
            return None
        keys, values = layer.keys, layer.values
        if keys.dim() != 4 or keys.shape[0] != 1 or keys.shape != values.shape:
            return None
        if keys.dtype != dtype or values.dtype != dtype or keys.device.type != "cpu":
            return None
        lengths.add(keys.shape[2])
    (length,) = lengths if len(lengths) == 1 else (None,)
    return length if length else None


class GrowingKV:
    """One cache's keys and values in buffers (1, KV heads, capacity, head dim) per layer, of
    which the cache's layers hold views of the first L positions (module doc)."""

    def __init__(self) -> None:
        self.buffers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.views: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.table: tuple | None = None  # (the blocks it was made for, the stack's table)

    def length(self, cache: Any) -> int | None:
        """L where every layer of ``cache`` still holds this object's views (of L positions) and
        the buffers have room for one more; else ``None`` (then :meth:`adopt`)."""
        layers = cache.layers
        if not self.views or len(layers) != len(self.views):
            return None
        for layer, (keys, values) in zip(layers, self.views, strict=True):
            if layer.keys is not keys or layer.values is not values:
                return None
        length = self.views[0][0].shape[2]
        return length if length < self.buffers[0][0].shape[2] else None

    def adopt(self, cache: Any, length: int) -> None:
        """Copy ``cache``'s ``length`` positions (:func:`usable`) into new buffers with room to
        grow, and give its layers views of them. Once, on a new object: the buffers then stay
        for its life (:attr:`table` holds their addresses)."""
        capacity = -(-(length + 1 + length // 4 + STEP) // STEP) * STEP
        for layer in cache.layers:
            pair = []
            for held in (layer.keys, layer.values):
                heads, _, dim = held.shape[1:]
                buffer = held.new_empty((1, heads, capacity, dim))
                buffer[:, :, :length].copy_(held)
                pair.append(buffer)
            self.buffers.append((pair[0], pair[1]))
        self.advance(cache, length)

    def advance(self, cache: Any, length: int) -> None:
        """Give ``cache``'s layers views of the buffers' first ``length`` positions."""
        self.views = [(k.narrow(2, 0, length), v.narrow(2, 0, length)) for k, v in self.buffers]
        for layer, (keys, values) in zip(cache.layers, self.views, strict=True):
            layer.keys, layer.values = keys, values
