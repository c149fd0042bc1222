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

import torch
from safetensors import SafetensorError
from torch import nn
from transformers.pytorch_utils import Conv1D

from lmcompress.compressor.formats.base import CompressedLinear
from lmcompress.compressor.formats.catalog import format_class
from lmcompress.compressor.io.layout import FORMAT_VERSION, TRANSFORMS_PREFIX
from lmcompress.compressor.io.shards import TensorFiles
from lmcompress.compressor.model.surgery import in_out_features, is_linear
from lmcompress.errors import ModelLoadError, shown


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


def check_transforms(transforms: Any, where: str) -> list[dict[str, Any]]:
    """``transforms`` checked: a list of ``{"kind": str, "meta": dict, "tensors": [str]}``."""
    if not isinstance(transforms, list):
        raise ModelLoadError(f"{where}: transforms is {shown(transforms)}, expected a list")
    for index, entry in enumerate(transforms):
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("kind"), str)
            and isinstance(entry.get("meta"), dict)
            and isinstance(entry.get("tensors"), list)
            and all(isinstance(key, str) for key in entry["tensors"])
        ):
            raise ModelLoadError(
                f"{where}: malformed transform {index} ({shown(entry)}; expected kind, meta, "
                "tensors)"
            )
    return transforms


def stored_keys(layers: dict[str, dict[str, Any]], transforms: list[dict[str, Any]]) -> set[str]:
    """Every key of ``compressed.safetensors`` the manifest lists (a version-1 bias read from
    the dense copy is not one)."""
    keys = {f"{name}.{key}" for name, entry in layers.items() for key in entry["tensors"]}
    return keys | {
        f"{TRANSFORMS_PREFIX}{index}.{key}"
        for index, entry in enumerate(transforms)
        for key in entry["tensors"]
    }


def check_unlisted(found: set[str], listed: set[str], where: str) -> None:
    """A :class:`ModelLoadError` if a stored compressed tensor is not in the manifest: the file
    and the manifest are not one export."""
    if extra := sorted(found - listed):
        raise ModelLoadError(
            f"{where} holds {len(extra)} tensor(s) the manifest does not list, e.g. {extra[0]}"
        )


def compare_manifests(
    config: Any, layers: dict[str, Any], transforms: list[dict[str, Any]], where: str
) -> None:
    """``config.json``'s ``quantization_config`` (``config``, ``None`` if absent) says what
    ``compression.json`` says (``layers``, ``transforms``): both are read by some loader, so
    where they disagree one loader would build another model."""
    if not isinstance(config, dict):
        raise ModelLoadError(f"{where}: config.json has no quantization_config for its layers")
    version = config.get("format_version", FORMAT_VERSION)
    copy = check_layers(config.get("compressed_layers", {}), version, f"{where}: config.json")
    if copy != layers:
        differ = sorted(set(copy) ^ set(layers)) or [
            name for name in sorted(layers) if copy[name] != layers[name]
        ]
        raise ModelLoadError(
            f"{where}: config.json's quantization_config disagrees with compression.json on "
            f"{len(differ)} layer(s), e.g. {differ[0]}"
        )
    if config.get("transforms", []) != transforms:
        raise ModelLoadError(
            f"{where}: config.json's quantization_config disagrees with compression.json on "
            "the transforms"
        )


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
    name: str,
    old: nn.Module,
    entry: dict[str, Any],
    packed,
    dense: TensorFiles | None,
    dtype: torch.dtype | None = None,
) -> CompressedLinear:
    """The compressed module that replaces the skeleton's layer ``name``.

    ``packed``: anything with ``get_tensor(key)`` (the open ``compressed.safetensors``, or
    meta tensors of the stored shapes for transformers' loader to fill); ``dense``: the dense
    tensors, read only for a version-1 layer's bias; ``dtype``: the export's dtype, which every
    floating tensor of the format's schema must be stored in (``None``: transformers' loader
    casts them to the model's)."""
    if not is_linear(old):
        raise ModelLoadError(f"compressed layer {name} is a {type(old).__name__}, not a linear")
    try:
        tensors = {key: packed.get_tensor(f"{name}.{key}") for key in entry["tensors"]}
    except SafetensorError as err:
        raise ModelLoadError(f"compressed layer {name} is incomplete: {err}") from None
    if entry.get("bias_in_dense") and old.bias is not None:
        tensors["bias"] = dense.get(f"{name}.bias")
    meta = {"conv1d": isinstance(old, Conv1D), **entry["meta"]}
    cls = format_class(entry["format"])
    try:
        new = cls.from_state(tensors, meta)
        if dtype is not None:
            cls.schema.check_stored_dtypes(cls.format, tensors, dtype)
    except ModelLoadError as err:
        raise ModelLoadError(f"compressed layer {name}: {err}") from None
    in_features, out_features = in_out_features(old)
    if (new.in_features, new.out_features) != (in_features, out_features):
        raise ModelLoadError(
            f"compressed layer {name} is {new.out_features}x{new.in_features}, but "
            f"{out_features}x{in_features} in the model config.json builds"
        )
    return new
