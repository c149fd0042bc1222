"""Rebuild one compressed layer from its stored entry: what every reader of an lmcompress output
shares (:mod:`~lmcompress.compressor.io.load` and transformers' loader through
:mod:`~lmcompress.compressor.io.hf_quantizer`).

An entry of ``compressed_layers`` is ``{"format", "meta", "tensors"}``; :func:`check_layers`
checks the entries (and rewrites version-1 ones), :func:`replay_layer` builds the module.
This module imports nothing that imports transformers' model code, so the quantizer that
transformers loads while it imports itself can import it at any time.
"""

from __future__ import annotations

from typing import Any

from safetensors import SafetensorError
from torch import nn
from transformers.pytorch_utils import Conv1D

from lmcompress.compressor.formats.base import CompressedLinear
from lmcompress.compressor.formats.catalog import format_class
from lmcompress.compressor.io.shards import TensorFiles
from lmcompress.compressor.model.surgery import in_out_features, is_linear
from lmcompress.errors import ModelLoadError


def check_layers(layers: Any, version: int, where: str) -> dict[str, dict[str, Any]]:
    """``compressed_layers`` checked (each entry a ``format`` name, a ``meta`` dict and tensor
    names), version-1 entries rewritten in today's form; a :class:`ModelLoadError` naming
    ``where`` otherwise. Shared by the manifest and the ``quantization_config`` of a compact
    export."""
    try:
        if version == 1:
            layers = {name: upgrade_v1(entry) for name, entry in layers.items()}
        for name, entry in layers.items():
            if not (isinstance(entry["format"], str) and isinstance(entry["meta"], dict)):
                raise TypeError(f"bad entry for {name}")
            entry["tensors"] = [str(key) for key in entry["tensors"]]
    except (AttributeError, KeyError, TypeError, ValueError) as err:
        raise ModelLoadError(f"{where}: malformed compressed_layers ({err})") from None
    return layers


def upgrade_v1(entry: dict[str, Any]) -> dict[str, Any]:
    """Version 1 stored only ``nm_packed``, with ``n, m, shape`` at the top level and the bias
    (if any) in the dense copy only."""
    out_features, in_features = entry["shape"]
    meta = {"in_features": in_features, "out_features": out_features, "n": entry["n"]}
    meta["m"] = entry["m"]
    return {
        "format": entry["format"],
        "meta": meta,
        "tensors": entry["tensors"],
        "bias_in_dense": True,
    }


def replay_layer(
    name: str, old: nn.Module, entry: dict[str, Any], packed, dense: TensorFiles | None
) -> CompressedLinear:
    """The compressed module that replaces the skeleton's layer ``name``.

    ``packed``: anything with ``get_tensor(key)`` (the open ``compressed.safetensors``, or
    meta tensors of the stored shapes for transformers' loader to fill); ``dense``: the dense
    tensors, read only for a version-1 layer's bias."""
    if not is_linear(old):
        raise ModelLoadError(f"compressed layer {name} is a {type(old).__name__}, not a linear")
    try:
        tensors = {key: packed.get_tensor(f"{name}.{key}") for key in entry["tensors"]}
    except SafetensorError as err:
        raise ModelLoadError(f"compressed layer {name} is incomplete: {err}") from None
    if entry.get("bias_in_dense") and old.bias is not None:
        tensors["bias"] = dense.get(f"{name}.bias")
    meta = {"conv1d": isinstance(old, Conv1D), **entry["meta"]}
    try:
        new = format_class(entry["format"]).from_state(tensors, meta)
    except ModelLoadError as err:
        raise ModelLoadError(f"compressed layer {name}: {err}") from None
    if (new.in_features, new.out_features) != in_out_features(old):
        raise ModelLoadError(
            f"compressed layer {name} is {new.out_features}x{new.in_features}, the model's "
            f"{in_out_features(old)[::-1]}"
        )
    return new
