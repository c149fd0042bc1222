"""transformers-native loading of the compact form: ``from_pretrained`` builds the runtime.

A directory written with ``save_compressed(..., dense_copy=False)`` holds no dense weight of its
compressed layers. Export adds two things to it, and changes none of the files
:func:`~lmcompress.compressor.io.load.load_compressed` reads:

- ``lmcompress.safetensors.index.json``: a safetensors index of the sharded-checkpoint kind whose
  ``weight_map`` names every tensor of ``model.safetensors`` (or its shards) and of
  ``compressed.safetensors``; ``config.json``'s ``transformers_weights`` points transformers at
  it, so ``from_pretrained`` reads both files and nothing else changes for other readers;
- ``config.json``'s ``quantization_config``: ``quant_method: "lmcompress"`` with the manifest's
  ``compressed_layers`` and ``transforms`` (a copy: the directory stays loadable when only the
  files transformers reads are copied, e.g. from the Hub).

``import lmcompress`` registers :class:`LmcompressConfig` and :class:`LmcompressHfQuantizer`
under that method (:mod:`lmcompress.compressor.io.hf_registration`). ``from_pretrained`` then calls
the quantizer before the weights are read: every layer named in the config is replaced, on the
meta device, by its runtime module built with ``from_state`` from tensors of the stored shapes
(read from the safetensors headers), so its parameter and buffer names are the stored keys and
transformers' own loader fills them. Afterwards the quantizer checks the loaded values as
``from_state`` does (positive finite scales) and installs the transforms (8-bit softmax). The
result is the packed runtime of ``load_compressed(out, runtime="packed")``: same modules, same
tensors, same logits.

This module imports transformers' quantizer machinery (seconds): import it only to load or write.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

# lmcompress.compressor.* is imported in the functions: register() can run while one of those
# modules is half imported (it imported transformers, whose import registers the quantizer).
from lmcompress.compressor.io.shards import SAFETENSORS_DTYPES  # torch and safetensors only
from lmcompress.errors import ModelLoadError

logger = logging.getLogger(__name__)

QUANT_METHOD = "lmcompress"
WEIGHTS_INDEX = "lmcompress.safetensors.index.json"  # what config.json's transformers_weights names
_TRANSFORMS = "transforms."  # key prefix of the transforms' tensors in compressed.safetensors


class LmcompressConfig(QuantizationConfigMixin):
    """``config.json``'s ``quantization_config`` of a compact export: the compressed layers
    (``{name: {"format", "meta", "tensors"}}``, as in ``compression.json``) and the transforms.
    Unknown keys and unreadable versions are a :class:`ModelLoadError`."""

    def __init__(
        self,
        compressed_layers: dict[str, Any] | None = None,
        transforms: list[dict[str, Any]] | None = None,
        format_version: int | None = None,  # None: today's
        quant_method: str = QUANT_METHOD,
        **unknown: Any,
    ) -> None:
        from lmcompress.compressor.io.load import FORMAT_VERSION, READABLE_VERSIONS, check_layers

        where = f"quantization_config ({QUANT_METHOD})"
        format_version = FORMAT_VERSION if format_version is None else format_version
        if unknown:
            raise ModelLoadError(
                f"{where}: unknown keys {', '.join(sorted(unknown))} (a newer lmcompress?)"
            )
        if format_version not in READABLE_VERSIONS:
            raise ModelLoadError(
                f"{where}: unsupported format_version {format_version!r} (this lmcompress "
                f"reads {', '.join(map(str, READABLE_VERSIONS))})"
            )
        if not isinstance(transforms or [], list):
            raise ModelLoadError(f"{where}: transforms must be a list")
        self.quant_method = quant_method
        self.format_version = format_version
        self.compressed_layers = check_layers(compressed_layers or {}, format_version, where)
        self.transforms = list(transforms or [])


class LmcompressHfQuantizer(HfQuantizer):
    """Builds the compressed runtime modules of a compact export inside ``from_pretrained``
    (see the module doc). Loads pre-compressed checkpoints only: it compresses nothing."""

    requires_calibration = True  # transformers refuses to use it on a dense checkpoint
    quantization_config: LmcompressConfig

    def __init__(self, quantization_config: LmcompressConfig, **kwargs: Any) -> None:
        super().__init__(quantization_config, **kwargs)
        self.stored: _StoredTensors | None = None

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **_):
        """Replace every compressed layer of the meta skeleton by its runtime module."""
        from lmcompress.compressor.io.load import replay_layer
        from lmcompress.compressor.model.surgery import replace_modules

        if not checkpoint_files:
            raise ModelLoadError(f"{QUANT_METHOD}: transformers named no checkpoint files")
        self.stored = _StoredTensors(checkpoint_files)
        layers = self.quantization_config.compressed_layers
        for name in layers:
            try:
                model.get_submodule(name)
            except AttributeError:
                raise ModelLoadError(
                    f"compressed layer {name} is not in the {model.config.model_type} model"
                ) from None
        skeleton = _MetaTensors(self.stored, layers, model.dtype)
        replace_modules(
            model, layers, lambda name, old: replay_layer(name, old, layers[name], skeleton, None)
        )
        # A family's _init_weights(parent) may reach into the replaced child's .weight (GPT-2
        # rescales mlp.c_proj.weight); the parents of the supported families hold no tensor of
        # their own, and their children are initialised (or loaded) one by one.
        for name in layers:
            model.get_submodule(name.rpartition(".")[0])._is_hf_initialized = True
        # the transforms' tensors are read below, not by transformers' loader
        ignored = set(model._keys_to_ignore_on_load_unexpected or ())
        model._keys_to_ignore_on_load_unexpected = ignored | {rf"^{_TRANSFORMS}"}
        return model

    def _process_model_after_weight_loading(self, model, **_):
        """Check the loaded values as ``from_state`` does; install the transforms."""
        from lmcompress.compressor.formats.base import format_class, transform_class

        for name, entry in self.quantization_config.compressed_layers.items():
            module = model.get_submodule(name)
            meta = {"conv1d": module.conv1d, **entry["meta"]}
            format_class(entry["format"]).from_state(module.state_tensors(), meta)
        device = next(model.parameters()).device
        for index, entry in enumerate(self.quantization_config.transforms):
            try:
                kind, meta, keys = entry["kind"], entry["meta"], entry["tensors"]
            except (KeyError, TypeError):
                raise ModelLoadError(f"{QUANT_METHOD}: malformed transform {index}") from None
            tensors = {key: self.stored.read(f"{_TRANSFORMS}{index}.{key}", device) for key in keys}
            transform_class(kind).from_state(tensors, meta).install(model)
        return model

    def is_serializable(self) -> bool:
        return False  # save_compressed writes lmcompress's layout; save_pretrained cannot

    @property
    def is_trainable(self) -> bool:
        return False


class _StoredTensors:
    """Where each tensor of the checkpoint files is, with its shape and dtype (headers only)."""

    def __init__(self, files: list[str]) -> None:
        self.where: dict[str, tuple[str, list[int], torch.dtype]] = {}
        for path in files:
            try:
                with safe_open(str(path), framework="pt") as f:
                    for key in f.keys():
                        piece = f.get_slice(key)
                        stored = piece.get_dtype()
                        if stored not in SAFETENSORS_DTYPES:
                            raise ModelLoadError(f"{path}: {key} has unsupported dtype {stored}")
                        self.where[key] = (str(path), piece.get_shape(), SAFETENSORS_DTYPES[stored])
            except (SafetensorError, OSError) as err:
                raise ModelLoadError(f"cannot read {path}: {err}") from None

    def header(self, key: str) -> tuple[list[int], torch.dtype]:
        if key not in self.where:
            raise ModelLoadError(f"{key} is stored in none of the checkpoint files")
        return self.where[key][1:]

    def read(self, key: str, device: torch.device) -> torch.Tensor:
        self.header(key)
        with safe_open(self.where[key][0], framework="pt", device=str(device)) as f:
            return f.get_tensor(key)


class _MetaTensors:
    """``get_tensor(key)``: an empty tensor on the meta device of the stored shape, for
    :func:`~lmcompress.compressor.io.load.replay_layer`. Floating tensors take the model's dtype
    (the
    loader casts them to it), except a format's ``exact_tensors`` (scales), which keep theirs."""

    def __init__(self, stored: _StoredTensors, layers: dict[str, Any], dtype: torch.dtype) -> None:
        from lmcompress.compressor.formats.base import format_class

        self.stored, self.dtype = stored, dtype
        self.exact = {
            f"{name}.{key}"
            for name, entry in layers.items()
            for key in format_class(entry["format"]).exact_tensors
        }

    def get_tensor(self, key: str) -> torch.Tensor:
        shape, dtype = self.stored.header(key)
        if dtype.is_floating_point and key not in self.exact:
            dtype = self.dtype
        return torch.empty(shape, dtype=dtype, device="meta")


def write_loading_entry(
    out_dir: Path,
    layers: dict[str, dict[str, Any]],
    transforms: list[dict[str, Any]],
    compressed_keys: list[str],
) -> None:
    """Make a compact export (``out_dir`` already holding ``config.json``, ``model.safetensors``
    or its shards, and ``compressed.safetensors`` with ``compressed_keys``) loadable by
    ``from_pretrained``: write :data:`WEIGHTS_INDEX` and point ``config.json`` at it, with the
    ``quantization_config`` that selects :class:`LmcompressHfQuantizer`."""
    from lmcompress.compressor.io.load import COMPRESSED_TENSORS, DENSE_TENSORS, FORMAT_VERSION

    sharded = out_dir / f"{DENSE_TENSORS}.index.json"
    if sharded.is_file():
        weight_map = dict(json.loads(sharded.read_text())["weight_map"])
    else:
        with safe_open(str(out_dir / DENSE_TENSORS), framework="pt") as f:
            weight_map = dict.fromkeys(f.keys(), DENSE_TENSORS)
    weight_map.update(dict.fromkeys(compressed_keys, COMPRESSED_TENSORS))
    index = {
        "metadata": {},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (out_dir / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    config_file = out_dir / "config.json"
    config = json.loads(config_file.read_text())
    config["quantization_config"] = {
        "quant_method": QUANT_METHOD,
        "format_version": FORMAT_VERSION,
        "compressed_layers": layers,
        "transforms": transforms,
    }
    config["transformers_weights"] = WEIGHTS_INDEX
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def register() -> None:
    """Register the config and the quantizer with transformers under :data:`QUANT_METHOD`
    (once: a second call does nothing)."""
    from transformers.quantizers import auto

    if QUANT_METHOD not in auto.AUTO_QUANTIZATION_CONFIG_MAPPING:
        auto.register_quantization_config(QUANT_METHOD)(LmcompressConfig)
    if QUANT_METHOD not in auto.AUTO_QUANTIZER_MAPPING:
        auto.register_quantizer(QUANT_METHOD)(LmcompressHfQuantizer)
    logger.debug("registered the %s quantizer with transformers", QUANT_METHOD)
