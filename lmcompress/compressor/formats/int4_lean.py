"""A decoder block of tiled int4 layers in the lean decode step's two calls
(``lmc_lean_int4_pre`` / ``lmc_lean_int4_post``, :file:`cpu_kernels.cpp`).

Through :mod:`lmcompress.compressor.lean_decode` a block makes seven linear calls and four
kernel calls; at SmolLM2's size on a 2-core CPU each int4 layer's Python path (module call, the
shared-input bookkeeping, the checks, ctypes) costs ~15 µs beside its ~15 µs of arithmetic.
Where q, k and v are one :class:`~lmcompress.compressor.formats.int4_shared.SharedInput`
group, gate and up another, and o and down tiled layers (:class:`Int4Linear`, or packed 2:4
:class:`PackedNMInt4Linear` on :mod:`~lmcompress.kernels.int4_tiles24`' tiles), :class:`Int4Block`
hands the whole block to two compiled calls around the cache update: the same kernels, on the
same tensors, in the same order as the separate calls, so the outputs are theirs bit for bit.
Its descriptor holds the tensors' addresses: :meth:`Int4Block.valid` checks before each step
that the layers still hold those modules and tensors (not moved, cast or replaced since).

Where every block of the model has such a plan, :func:`run_stack` runs them all in one call
(``lmc_lean_int4_stack``): the two calls of each block with the cache update between them done
in place, the token's k and v written into :class:`~lmcompress.compressor.lean_cache.GrowingKV`
buffers (:func:`stack_table` holds their addresses), the same arithmetic bit for bit.
"""

from __future__ import annotations

import operator
import struct

import torch
from torch import nn

from lmcompress.compressor.formats.int4 import Int4Linear, PackedNMInt4Linear
from lmcompress.compressor.lean_cache import GrowingKV
from lmcompress.kernels import cpu_kernels, lean_step

_KEYS = ("qweight", "scales16", "zeros16", "bias")
_KEYS24 = (*_KEYS, "indices")  # a tiled packed 2:4 layer's patterns too
_PARTS = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
_ATTN, _MLP = ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj")
_TILED = (Int4Linear, PackedNMInt4Linear)  # tiled int4, or packed 2:4 int4 (int4_tiles24)


def _group(members: list[nn.Module]) -> object | None:
    """The shared-input group that is exactly ``members``, in order, still holding its views."""
    shared = members[0].__dict__.get("shared_input")
    if shared is None or not all(_tiled(m) for m in members):
        return None
    group = shared[0]
    if list(group.layers) != members:
        return None
    return group if all(group.holds(m, i) for i, m in enumerate(members)) else None


def _tiled(module: nn.Module) -> bool:
    return type(module) in _TILED and module.tiled


def _keys(module: nn.Module) -> tuple[str, ...]:
    return _KEYS24 if type(module) is PackedNMInt4Linear else _KEYS


class Int4Block:
    """One decoder block's descriptor for the two calls (module doc)."""

    def __init__(self, layer: nn.Module, qkv: object, gate_up: object) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        self.layer = layer
        self.singles = [
            (m, {k: m._buffers[k] for k in _keys(m)}) for m in (attn.o_proj, mlp.down_proj)
        ]
        self.heads = attn.q_proj.out_features // attn.head_dim
        self.kv_heads = attn.k_proj.out_features // attn.head_dim
        self.head_dim = attn.head_dim
        self.qkv_out = qkv.out_features
        words = [norms[0].data_ptr(), norms[1].data_ptr(), lean_step.KINDS[norms[0].dtype]]
        words += [attn.q_proj.in_features, self.heads, self.kv_heads, self.head_dim]
        words += [mlp.down_proj.in_features]
        for held, shape in (
            (qkv.buffers, (qkv.in_features, qkv.out_features)),
            (self.singles[0][1], (attn.o_proj.in_features, attn.o_proj.out_features)),
            (gate_up.buffers, (gate_up.in_features, gate_up.out_features)),
            (self.singles[1][1], (mlp.down_proj.in_features, mlp.down_proj.out_features)),
        ):
            bias, groups, patterns = held["bias"], held["scales16"].shape[1], held.get("indices")
            words += [held["qweight"].data_ptr(), 0 if patterns is None else patterns.data_ptr()]
            words += [held["scales16"].data_ptr(), held["zeros16"].data_ptr()]
            words += (
                [0, 0] if bias is None else [bias.data_ptr(), cpu_kernels.FLOAT_KINDS[bias.dtype]]
            )
            words += [shape[0], shape[1], groups, shape[0] // groups]
        self.desc = torch.tensor(words, dtype=torch.int64)
        self.held = tuple(zip(*_held(layer, (qkv, gate_up), self.singles), strict=True))

    def valid(self) -> bool:
        """Whether the block still holds the modules and tensors the descriptor points to."""
        owners, keys, held = self.held
        return all(map(operator.is_, map(dict.get, owners, keys), held))  # C loops: ~2 µs

    def pre(self, x, add, eps, cos, sin) -> torch.Tensor:
        """``x += add``; the roped q | k | v of ``norm(x)``, (1, 1, qkv width)."""
        qkv = x.new_empty((1, 1, self.qkv_out))
        lean_step.library().lmc_lean_int4_pre(
            self.desc.data_ptr(), x.data_ptr(), None if add is None else add.data_ptr(),
            lean_step.KINDS[x.dtype], eps, cos.data_ptr(), sin.data_ptr(), qkv.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        return qkv

    def post(self, x, qkv, keys, values, scale, eps) -> torch.Tensor:
        """``x += o(attend(q))``; the MLP's output on ``norm(x)`` (the next residual update)."""
        if keys.stride() != values.stride():
            keys, values = keys.contiguous(), values.contiguous()
        down = torch.empty_like(x)
        lean_step.library().lmc_lean_int4_post(
            self.desc.data_ptr(), x.data_ptr(), qkv.data_ptr(), keys.data_ptr(),
            values.data_ptr(), lean_step.KINDS[keys.dtype], keys.shape[2], keys.stride(1),
            keys.stride(2), scale, lean_step.KINDS[x.dtype], eps, down.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        return down


def _held(layer: nn.Module, groups: tuple, singles: list) -> list[tuple[dict, str, object]]:
    """(owner dict, key, object) for every module and tensor a block's descriptor relies on:
    the block's attention, MLP, norms and linears where the layer holds them, the norms'
    weights, the groups' shared views and the single layers' buffers."""
    attn, mlp = layer.self_attn, layer.mlp
    held = [(layer._modules, name, getattr(layer, name)) for name in _PARTS]
    held += [(attn._modules, name, getattr(attn, name)) for name in _ATTN]
    held += [(mlp._modules, name, getattr(mlp, name)) for name in _MLP]
    for name in ("input_layernorm", "post_attention_layernorm"):
        norm = getattr(layer, name)
        held.append((norm._parameters, "weight", norm.weight))
    for group in groups:
        for member, views in zip(group.layers, group.views, strict=True):
            held += [(member._buffers, k, v) for k, v in zip(group.keys, views, strict=True)]
    for module, buffers in singles:
        held += [(module._buffers, key, tensor) for key, tensor in buffers.items()]
    return held


def stack_table(blocks: list[Int4Block], kv: GrowingKV) -> torch.Tensor:
    """``lmc_lean_int4_stack``'s table (:file:`cpu_kernels.cpp`): for each block its
    descriptor, its layer's KV buffers and strides, its norms' eps and attention scale."""
    rows = []
    for block, (keys, values) in zip(blocks, kv.buffers, strict=True):
        layer = block.layer
        floats = (
            layer.input_layernorm.variance_epsilon,
            layer.post_attention_layernorm.variance_epsilon,
            layer.self_attn.scaling,
        )
        rows.append(
            [block.desc.data_ptr(), keys.data_ptr(), values.data_ptr(), lean_step.KINDS[keys.dtype]]
            + [keys.stride(1), keys.stride(2)]
            + [struct.unpack("<I", struct.pack("<f", f))[0] for f in floats]
        )
    return torch.tensor(rows, dtype=torch.int64)


def run_stack(table: torch.Tensor, x, cos, sin, length: int) -> torch.Tensor:
    """Every block of ``table`` on ``x`` (1, 1, hidden; updated in place), the token at
    position ``length``: its k and v written into the KV buffers at ``length``. Returns the
    last block's MLP output (the residual update the final norm adds)."""
    down = torch.empty_like(x)
    lean_step.library().lmc_lean_int4_stack(
        table.data_ptr(), table.shape[0], length, x.data_ptr(), lean_step.KINDS[x.dtype],
        cos.data_ptr(), sin.data_ptr(), down.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return down


def plan(layer: nn.Module) -> Int4Block | None:
    """An :class:`Int4Block` for ``layer`` (a Llama decoder block), or ``None`` where its
    linears are not laid out for it (module doc) or the kernels are not built."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv = _group([attn.q_proj, attn.k_proj, attn.v_proj])
    gate_up = _group([mlp.gate_proj, mlp.up_proj])
    singles = (attn.o_proj, mlp.down_proj)
    if qkv is None or gate_up is None or lean_step.library() is None:
        return None
    if any(not _tiled(m) or "shared_input" in m.__dict__ for m in singles):
        return None
    weights = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
    if any(not w.is_contiguous() or not w.is_cpu for w in weights):
        return None
    return Int4Block(layer, qkv, gate_up)
