"""Structures of decoder blocks and their extraction into a smaller model of the same architecture.

Three kinds (:data:`KINDS`), located through the family table (``families.Structures``):

- ``channels``: one hidden channel of the MLP: a row of each ``out`` linear (gate and up, or
  the first projection), with its bias, and the matching column of the ``in`` linear (down);
- ``heads``: one KV group: a key head, a value head and the query heads that attend with them
  (GQA's ``num_attention_heads / num_key_value_heads``), i.e. their rows of q, k and v and
  their columns of o;
- ``layers``: a whole decoder block, skipped through the residual.

:class:`StructureGates` multiplies each structure by a value with hooks, the weights untouched
(a channel's activation entering down, a group's attention output entering o, a block's two
residual updates); :func:`extract_` removes the structures a keep-mask drops, folds each kept
structure's scale into the linear that consumes it (down's column, o's columns, the output
projections' rows and biases) and writes the smaller widths into ``model.config``: the model
then computes what the gated model computes (to float rounding: sums over fewer terms) and
saves as a standard checkpoint. Every block keeps the same widths (``uniform``), since a
standard config has one width per kind.

Per-layer widths (``uniform=False``): each block keeps its own count; where the counts differ,
``config.json`` holds the widest block's (what a plain loader builds, so that it refuses the
narrower weights) and :data:`WIDTHS_FIELD` the list per block, which :func:`apply_widths_`
reads back into a skeleton built from the config (lmcompress's loader does, before reading
the weights).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from lmcompress.compressor.model.families import Structures, decoder_blocks, family_of
from lmcompress.compressor.model.surgery import weight_matrix
from lmcompress.errors import ConfigError, ModelLoadError

KINDS = ("heads", "channels", "layers")
WIDTHS_FIELD = "lmcompress_widths"  # config.json: {field: [width of each block]}


def structures_of(model: nn.Module, kinds: Iterable[str]) -> Structures:
    """The family's :class:`Structures`; a :class:`ConfigError` naming the first of ``kinds``
    it does not have (or an unknown kind)."""
    family = family_of(model)
    model_type = model.config.model_type
    for kind in kinds:
        if kind not in KINDS:
            raise ConfigError(f"unknown structure {kind!r}; choose from {', '.join(KINDS)}")
    if family.structures is None:
        raise ConfigError(f"structured extraction does not support {model_type!r} models")
    if "heads" in kinds and family.structures.kv_groups is None:
        raise ConfigError(
            f"--structure heads: {model_type!r} derives its head size from the hidden size, so "
            "fewer heads have no standard config; use channels or layers"
        )
    return family.structures


@dataclass(frozen=True)
class BlockShape:
    """The structures of one decoder block and the parameters each removes."""

    channels: int
    channel_params: int
    groups: int  # KV groups (0: the family has none)
    group_params: int
    params: int  # the whole block's


def attention_layout(config) -> tuple[int, int, int]:
    """``(kv_groups, query heads per group, head_dim)`` of a config."""
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return kv, heads // kv, head_dim


def _params_along(module: nn.Module, axis: str) -> int:
    """Parameters of one index of ``module`` along ``axis`` (a row with its bias, or a column)."""
    out_features, in_features = weight_matrix(module).shape
    if axis == "out":
        return in_features + (module.bias is not None)
    return out_features


def block_shape(model: nn.Module, block: nn.Module) -> BlockShape:
    structures = structures_of(model, ())
    mlp = [(block.get_submodule(path), axis) for path, axis in structures.mlp]
    channels = weight_matrix(mlp[0][0]).shape[0]
    groups = group_params = 0
    if structures.kv_groups is not None:
        groups, per_group, head_dim = attention_layout(model.config)
        q, k, v, o = (block.get_submodule(p) for p in structures.kv_groups)
        rows = (
            per_group * _params_along(q, "out") + _params_along(k, "out") + _params_along(v, "out")
        )
        group_params = head_dim * (rows + per_group * _params_along(o, "in"))
    return BlockShape(
        channels=channels,
        channel_params=sum(_params_along(m, axis) for m, axis in mlp),
        groups=groups,
        group_params=group_params,
        params=sum(p.numel() for p in block.parameters()),
    )


def block_shapes(model: nn.Module) -> list[BlockShape]:
    return [block_shape(model, block) for block in decoder_blocks(model)]


class StructureGates:
    """Multipliers on ``model``'s structures of ``kinds``, applied by hooks: set ``values[kind]``
    to a tensor (blocks, channels), (blocks, groups) or (blocks, 2) (a block's attention and
    MLP updates), or ``None`` (no gate); ``enabled`` off: no gate at all (the dense model, a
    distillation's teacher); :meth:`remove` takes the hooks off."""

    def __init__(self, model: nn.Module, kinds: Iterable[str]) -> None:
        kinds = tuple(kinds)
        structures = structures_of(model, kinds)
        self.values: dict[str, torch.Tensor | None] = dict.fromkeys(kinds)
        self.enabled = True
        self._handles = []
        kv, _, _ = attention_layout(model.config) if "heads" in kinds else (0, 0, 0)
        for b, block in enumerate(decoder_blocks(model)):
            if "channels" in kinds:
                down = next(block.get_submodule(p) for p, axis in structures.mlp if axis == "in")
                self._handles.append(down.register_forward_pre_hook(self._channels(b)))
            if "heads" in kinds:
                o = block.get_submodule(structures.kv_groups[3])
                self._handles.append(o.register_forward_pre_hook(self._heads(b, kv)))
            if "layers" in kinds:
                for i, path in enumerate((structures.attention_out, structures.mlp_out)):
                    out = block.get_submodule(path)
                    self._handles.append(out.register_forward_hook(self._update(b, i)))

    def _channels(self, b: int):
        def hook(_module, args):
            gate = self.values["channels"] if self.enabled else None
            return None if gate is None else (args[0] * gate[b].to(args[0].dtype), *args[1:])

        return hook

    def _heads(self, b: int, kv: int):
        def hook(_module, args):
            gate = self.values["heads"] if self.enabled else None
            if gate is None:
                return None
            x = args[0]
            grouped = x.reshape(*x.shape[:-1], kv, -1) * gate[b].to(x.dtype)[:, None]
            return (grouped.reshape(x.shape), *args[1:])

        return hook

    def _update(self, b: int, i: int):
        def hook(_module, _args, output):
            gate = self.values["layers"] if self.enabled else None
            return None if gate is None else output * gate[b, i].to(output.dtype)

        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _slice_(module: nn.Module, axis: str, index: torch.Tensor, scale=None) -> None:
    """Keep ``index`` of ``module``'s (out, in) weight along ``axis`` (and the bias's, for
    ``out``); ``scale`` (len(index),) multiplies the kept columns (``in`` only)."""
    W = weight_matrix(module).detach()
    W = W[index] if axis == "out" else W[:, index]
    if scale is not None:
        W = W * scale.to(W)
    conv1d = isinstance(module, Conv1D)
    module.weight = nn.Parameter((W.t() if conv1d else W).contiguous(), requires_grad=False)
    if axis == "out" and module.bias is not None:
        module.bias = nn.Parameter(module.bias.detach()[index].clone(), requires_grad=False)
    if conv1d:
        module.nf, module.nx = W.shape
    else:
        module.out_features, module.in_features = W.shape


def _scale_outputs_(module: nn.Module, factor: torch.Tensor) -> None:
    """Multiply ``module``'s outputs by ``factor`` (weight and bias)."""
    module.weight.data.mul_(factor.to(module.weight))
    if module.bias is not None:
        module.bias.data.mul_(factor.to(module.bias))


def _counts(keep: torch.Tensor, kind: str, uniform: bool) -> list[int]:
    """What each block keeps of ``kind``: one width for all where ``uniform``, none empty."""
    counts = keep.sum(dim=1).tolist()
    if uniform and len(set(counts)) > 1:
        raise ConfigError(f"{kind}: blocks keep {counts}; a standard config needs one width")
    if min(counts) == 0:
        raise ConfigError(f"{kind}: the budget removes every {kind[:-1]} of a block")
    return counts


@torch.no_grad()
def extract_(
    model: nn.Module,
    keep: dict[str, torch.Tensor],
    scales: dict[str, torch.Tensor | None] | None = None,
    uniform: bool = True,
) -> dict[str, int | dict[str, list[int]]]:
    """Remove from ``model`` (in place) what ``keep`` drops: ``keep[kind]`` bool of
    :class:`StructureGates`' shape (``layers``: (blocks,)); ``scales[kind]`` (same shapes as the
    gates, ``layers`` (blocks, 2)) are folded into the kept structures; ``uniform=False``: each
    block its own widths (module doc). Returns the new sizes (config field -> value, and
    :data:`WIDTHS_FIELD` where blocks differ), also written into ``model.config``."""
    scales = scales or {}
    structures = structures_of(model, keep)
    blocks = decoder_blocks(model)
    config, widths = model.config, {}
    if "channels" in keep:
        widths[structures.mlp_width] = _counts(keep["channels"], "channels", uniform)
    if "heads" in keep:
        widths["num_key_value_heads"] = _counts(keep["heads"], "heads", uniform)
    for b, block in enumerate(blocks):
        if "channels" in keep:
            index = keep["channels"][b].nonzero().squeeze(1)
            scale = scales.get("channels")
            for path, axis in structures.mlp:
                part = scale[b][index] if scale is not None and axis == "in" else None
                _slice_(block.get_submodule(path), axis, index, part)
        if "heads" in keep:
            _extract_groups(block, structures, keep["heads"][b], scales.get("heads"), b, config)
        if scales.get("layers") is not None:
            for i, path in enumerate((structures.attention_out, structures.mlp_out)):
                _scale_outputs_(block.get_submodule(path), scales["layers"][b, i])
    sizes: dict = {}
    if "layers" in keep:
        kept = keep["layers"].nonzero().squeeze(1).tolist()
        if not kept:
            raise ConfigError("layers: the budget removes every decoder block")
        _keep_blocks_(model, kept)
        sizes["num_hidden_layers"] = len(kept)
        widths = {field: [counts[i] for i in kept] for field, counts in widths.items()}
    sizes |= _config_sizes(config, widths)
    for field, value in sizes.items():
        setattr(config, field, value)
    return sizes


def _config_sizes(config, widths: dict[str, list[int]]) -> dict:
    """The config fields of the kept ``widths`` (per block): the widest block's, and the lists
    under :data:`WIDTHS_FIELD` where the blocks differ."""
    sizes: dict = {field: max(counts) for field, counts in widths.items()}
    if "num_key_value_heads" in widths:
        _kv, per_group, head_dim = attention_layout(config)
        sizes["num_attention_heads"] = sizes["num_key_value_heads"] * per_group
        sizes["head_dim"] = head_dim
    differ = {field: counts for field, counts in widths.items() if len(set(counts)) > 1}
    if differ:
        sizes[WIDTHS_FIELD] = differ
    return sizes


@torch.no_grad()
def apply_widths_(model: nn.Module) -> None:
    """Give a model built from a config with :data:`WIDTHS_FIELD` (e.g. a skeleton on the meta
    device) each block's own widths, the first ones of each kind kept: then its shapes are
    those of the per-layer checkpoint. A :class:`ModelLoadError` for a malformed field."""
    widths = getattr(model.config, WIDTHS_FIELD, None)
    if widths is None:
        return
    if not isinstance(widths, dict):
        raise ModelLoadError(f"config.json: malformed {WIDTHS_FIELD}: not a mapping")
    structures, blocks = structures_of(model, ()), decoder_blocks(model)
    known = {structures.mlp_width: "channels", "num_key_value_heads": "heads"}
    for field, counts in widths.items():
        widest = getattr(model.config, field, None)
        if (
            field not in known
            or not isinstance(widest, int)
            or not isinstance(counts, list)
            or len(counts) != len(blocks)
            or not all(type(c) is int and 0 < c <= widest for c in counts)
        ):
            raise ModelLoadError(f"config.json: malformed {WIDTHS_FIELD} entry {field!r}")
        if known[field] == "heads":
            structures_of(model, ("heads",))
        for b, (block, count) in enumerate(zip(blocks, counts, strict=True)):
            first = torch.arange(widest) < count
            if known[field] == "channels":
                for path, axis in structures.mlp:
                    _slice_(block.get_submodule(path), axis, first.nonzero().squeeze(1))
            else:
                _extract_groups(block, structures, first, None, b, model.config)
    for param in model.parameters():
        param.requires_grad_(True)  # as a model built from the config has them (slicing froze)


def _extract_groups(block, structures, keep, scale, b, config) -> None:
    """One block's KV groups: q rows by groups of ``per_group · head_dim``, k and v rows by
    ``head_dim``, o columns as q's rows (times the group's scale)."""
    _kv, per_group, head_dim = attention_layout(config)
    groups = keep.nonzero().squeeze(1)
    within = torch.arange(head_dim)
    kv_rows = (groups[:, None] * head_dim + within).flatten()
    q_width = per_group * head_dim
    q_rows = (groups[:, None] * q_width + torch.arange(q_width)).flatten()
    q, k, v, o = (block.get_submodule(p) for p in structures.kv_groups)
    _slice_(q, "out", q_rows)
    _slice_(k, "out", kv_rows)
    _slice_(v, "out", kv_rows)
    part = None if scale is None else scale[b][groups].repeat_interleave(q_width)
    _slice_(o, "in", q_rows, part)


def _keep_blocks_(model: nn.Module, kept: list[int]) -> None:
    """Only the blocks ``kept`` (indices, in order), renumbered (``layer_idx``: the KV cache's
    slot), and the config's per-block lists cut to match."""
    family = family_of(model)
    blocks = decoder_blocks(model)
    parent, _, attr = family.blocks.rpartition(".")
    new = nn.ModuleList([blocks[i] for i in kept])
    setattr(model.get_submodule(parent), attr, new)
    for i, block in enumerate(new):
        for module in block.modules():
            if hasattr(module, "layer_idx"):
                module.layer_idx = i
    layer_types = getattr(model.config, "layer_types", None)
    if isinstance(layer_types, list) and len(layer_types) == len(blocks):
        model.config.layer_types = [layer_types[i] for i in kept]
