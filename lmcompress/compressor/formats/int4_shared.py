"""One decode kernel call for the int4 layers that read the same input (q, k and v; gate and
up; tiled int4 or tiled packed 2:4 int4 alike): at batch-1 decode on SmolLM2 each layer's call
costs a fixed ~10 µs (Python, ctypes, activation quantization, starting the threads) beside
5–25 µs of arithmetic, and a decoder block makes seven.

:func:`share_inputs` finds the siblings (the family's ``shared_inputs`` names under one parent
module) that are tiled :class:`Int4Linear` layers on one grid (or tiled 2:4
:class:`PackedNMInt4Linear` ones, their patterns too), concatenates their tiles, scales,
zeros and biases into one :class:`SharedInput`, and makes each layer's buffers views of those
(no memory is added). At decode the first sibling called computes every sibling's rows in one
kernel call and keeps the result for the others; each sibling is served once per input, and
only for the very same input tensor (``is``, not equality), so a sibling called on anything
else, or twice, computes its own rows as before. Outputs are those of the separate calls bit
for bit: the kernel computes each row alone. Prefill, gradients, tracing and a model moved
to another device (the views then replaced) take each layer's own path.
"""

from __future__ import annotations

import logging
import mmap

import torch
from torch import nn

from lmcompress.compressor.formats.int4 import Int4CodedLinear, Int4Linear, PackedNMInt4Linear
from lmcompress.compressor.formats.nm_packed import PackedNMLinear
from lmcompress.compressor.model.families import decoder_blocks, family_of
from lmcompress.errors import ModelLoadError
from lmcompress.kernels import int4_tiles, int4_tiles24

logger = logging.getLogger(__name__)

_KEYS = ("qweight", "scales16", "zeros16", "bias")  # what the decode kernel reads
_KEYS24 = (*_KEYS, "indices")  # and a tiled 2:4 layer's patterns
_TILED = (Int4Linear, PackedNMInt4Linear)
_HUGE_PAGE = 2 << 20


class SharedInput:
    """Sibling tiled int4 layers computed by one kernel call (module doc)."""

    def __init__(self, members: list[Int4CodedLinear]) -> None:
        first = members[0]
        self.in_features = first.in_features
        self.keys = _KEYS24 if type(first) is PackedNMInt4Linear else _KEYS
        self.decode = int4_tiles24.try_decode if self.keys is _KEYS24 else int4_tiles.try_decode
        self.spans, start = [], 0
        for member in members:
            self.spans.append((start, start + member.out_features))
            start += member.out_features
        self.out_features = start
        self.layers = members
        self.members = len(members)
        self.pending: tuple[torch.Tensor, torch.Tensor, set[int]] | None = None
        self.bind({key: _cat([m._buffers[key] for m in members]) for key in self.keys})
        for index, member in enumerate(members):
            member.shared_input = (self, index)

    def bind(self, buffers: dict[str, torch.Tensor | None]) -> None:
        """Hold ``buffers`` (the siblings' concatenated tensors) and make each sibling's
        buffers views of them."""
        self.buffers, self.views = buffers, []
        for member, (a, b) in zip(self.layers, self.spans, strict=True):
            blocks = slice(a // int4_tiles.ROWS, b // int4_tiles.ROWS)
            member.qweight = buffers["qweight"][blocks]
            member.scales16 = buffers["scales16"][blocks]
            member.zeros16 = buffers["zeros16"][blocks]
            if "indices" in buffers:
                member.indices = buffers["indices"][blocks]
            if member.bias is not None:
                member.bias = buffers["bias"][a:b]
            self.views.append(tuple(member._buffers[k] for k in self.keys))

    def holds(self, member: Int4CodedLinear, index: int) -> bool:
        """Whether ``member`` (sibling ``index``) still holds the shared views (not moved to
        another device or dtype, nor its buffers replaced, since sharing)."""
        held = member._buffers
        views = zip(self.keys, self.views[index], strict=True)
        return all(held[key] is view for key, view in views)

    def forward(self, member: Int4CodedLinear, index: int, x: torch.Tensor) -> torch.Tensor | None:
        """Member ``index``'s decode output for ``x``, from the shared call (made now, or kept
        from a sibling's call on this same ``x``); ``None`` where the decode kernel does not
        apply or ``member`` no longer holds the shared views (the caller computes alone)."""
        pending = self.pending
        if pending is not None and pending[0] is x and index not in pending[2]:
            y = pending[1]
            pending[2].add(index)
            if len(pending[2]) == self.members:
                self.pending = None  # every sibling served: nothing kept between steps
        else:
            if not self.holds(member, index):
                return None  # moved or reassigned since sharing: its own buffers
            y = self.decode(x, self.buffers, self.in_features, self.out_features)
            if y is None:
                return None
            self.pending = (x, y, {index})
        a, b = self.spans[index]
        return y.narrow(-1, a, b - a)


def _cat(tensors: list[torch.Tensor | None]) -> torch.Tensor | None:
    return None if tensors[0] is None else torch.cat(tensors)


def _siblings(parent: nn.Module, names: tuple[str, ...]) -> list[Int4CodedLinear] | None:
    members = [getattr(parent, name, None) for name in names]
    if not all(type(m) in _TILED and m.tiled for m in members):
        return None

    def grid(m: Int4CodedLinear) -> tuple:
        return type(m), m.in_features, m.bits, m.group_size, m.qweight.device, m.bias is None

    same = all(
        grid(m) == grid(members[0])
        and m.out_features % int4_tiles.ROWS == 0
        and getattr(m, "shared_input", None) is None
        for m in members
    )
    return members if same else None


def share_inputs(model: nn.Module) -> int:
    """Group the siblings of every decoder block (module doc); returns how many groups."""
    try:
        groups = family_of(model).shared_inputs
        blocks = decoder_blocks(model)
    except (ModelLoadError, AttributeError):
        return 0  # not a supported decoder model: nothing to share
    count = 0
    for block in blocks:
        for parent in block.modules():
            for names in groups:
                members = _siblings(parent, names)
                if members is not None:
                    SharedInput(members)
                    count += 1
    if count:
        logger.debug("int4 layers sharing an input: %d groups, one decode call each", count)
    return count


def place_in_huge_pages(model: nn.Module) -> int:
    """Move what the int4 decode kernel reads (tiles and their grid, of every tiled layer and
    shared group) into one private anonymous mapping advised for transparent huge pages
    (``MADV_HUGEPAGE``; Linux): a decode step streams all of it, and 2 MiB pages spare the
    4 KiB pages' TLB misses (about 3 % of a SmolLM2 step on the host of the committed speed
    results). Returns the bytes moved; 0 where the platform has no such advice or there is less
    than one huge page of them. The same values: only their place changes (and a copy of the
    model, or a move to another device, takes ordinary memory)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return 0
    owners: dict[int, tuple[object, dict[str, torch.Tensor]]] = {}
    for module in model.modules():
        if type(module) not in _TILED or not module.tiled or not module.qweight.is_cpu:
            continue
        shared = module.__dict__.get("shared_input")
        owner = shared[0] if shared is not None else module
        held = owner.buffers if shared is not None else module._buffers
        keys = [key for key in _KEYS24 if key != "bias" and key in held]
        owners[id(owner)] = (owner, {key: held[key] for key in keys})
    sizes = [
        -(-t.numel() * t.element_size() // 64) * 64
        for _, ts in owners.values()
        for t in ts.values()
    ]
    total = sum(sizes)
    if total < _HUGE_PAGE:
        return 0
    arena = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    arena.madvise(mmap.MADV_HUGEPAGE)
    memory = torch.frombuffer(arena, dtype=torch.uint8)  # keeps the mapping alive
    offset = 0
    for owner, tensors in owners.values():
        placed = {}
        for key, tensor in tensors.items():
            n = tensor.numel() * tensor.element_size()
            view = memory[offset : offset + n].view(tensor.dtype).view(tensor.shape)
            placed[key] = view.copy_(tensor)
            offset += -(-n // 64) * 64
        if isinstance(owner, SharedInput):
            owner.bind({**placed, "bias": owner.buffers["bias"]})
        else:
            for key, view in placed.items():
                setattr(owner, key, view)
    return total


def prepare_decode(model: nn.Module) -> None:
    """The decode layouts of a loaded model: 2:4 float layers on tiles
    (:meth:`PackedNMLinear.tile`), then for int4 :func:`share_inputs` and
    :func:`place_in_huge_pages`."""
    for module in model.modules():
        if isinstance(module, PackedNMLinear):
            module.tile()
    share_inputs(model)
    placed = place_in_huge_pages(model)
    if placed:
        logger.debug("int4 decode tensors in huge pages: %.1f MiB", placed / 2**20)
