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

This module imports transformers' quantizer machinery (seconds): only the registration hook
imports it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from transformers.quantizers import auto
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

# The model code (replay, surgery, formats) is imported in the methods: register() runs right
# after transformers' quantizer registry is first imported, which can happen while one of those
# modules is half imported (lmcompress.compressor.util.optional lists this deferral).
from lmcompress.compressor.io.layout import (
    FORMAT_VERSION,
    MANIFEST,
    QUANT_METHOD,
    READABLE_VERSIONS,
    TRANSFORMS_PREFIX,
)
from lmcompress.compressor.io.shards import TensorFiles  # torch and safetensors only
from lmcompress.errors import ModelLoadError

logger = logging.getLogger(__name__)


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
        from lmcompress.compressor.io.replay import check_layers, check_transforms

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
        self.quant_method = quant_method
        self.format_version = format_version
        self.compressed_layers = check_layers(compressed_layers or {}, format_version, where)
        self.transforms = check_transforms(list(transforms or []), where)


class LmcompressHfQuantizer(HfQuantizer):
    """Builds the compressed runtime modules of a compact export inside ``from_pretrained``
    (see the module doc). Loads pre-compressed checkpoints only: it compresses nothing."""

    requires_calibration = True  # transformers refuses to use it on a dense checkpoint
    quantization_config: LmcompressConfig

    def __init__(self, quantization_config: LmcompressConfig, **kwargs: Any) -> None:
        super().__init__(quantization_config, **kwargs)
        self.stored: TensorFiles | None = None

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **_):
        """Replace every compressed layer of the meta skeleton by its runtime module."""
        from lmcompress.compressor.io.replay import check_unlisted, replay_layer, stored_keys
        from lmcompress.compressor.model.surgery import replace_modules

        if not checkpoint_files:
            raise ModelLoadError(f"{QUANT_METHOD}: transformers named no checkpoint files")
        self.stored = TensorFiles.of_files(checkpoint_files)
        layers = self.quantization_config.compressed_layers
        transforms = self.quantization_config.transforms
        manifest = self.compare_manifest(Path(checkpoint_files[0]).parent)
        # a stored tensor under a compressed layer or a transform must be one the config lists
        prefixes = (TRANSFORMS_PREFIX, *(f"{name}." for name in layers))
        found = {key for key in self.stored.files if key.startswith(prefixes)}
        check_unlisted(found, stored_keys(layers, transforms), f"{QUANT_METHOD} checkpoint")
        for name in layers:
            try:
                model.get_submodule(name)
            except AttributeError:
                raise ModelLoadError(
                    f"compressed layer {name} is not in the {model.config.model_type} model"
                ) from None
        self.check_dense_keys(model, layers)
        if manifest is not None:
            self.check_stored_dtypes(model, layers, manifest["dtype"])
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
        model._keys_to_ignore_on_load_unexpected = ignored | {rf"^{TRANSFORMS_PREFIX}"}
        return model

    def check_dense_keys(self, model, layers: dict[str, Any]) -> None:
        """Every tensor of the skeleton outside the compressed layers is stored (or tied to
        one that is), and nothing else is: transformers would initialise a missing one at
        random and skip an unknown one, and only say so in its load report."""
        from lmcompress.compressor.io.load import key_renaming

        rename = key_renaming(model)
        present = {rename(key) for key in self.stored.files}
        tied = set(getattr(model, "all_tied_weights_keys", None) or {})
        skip = tuple(f"{name}." for name in layers)
        missing = sorted(
            key
            for key in model.state_dict()
            if key not in present and key not in tied and not key.startswith(skip)
        )
        if missing:
            raise ModelLoadError(
                f"{QUANT_METHOD} checkpoint: {len(missing)} tensor(s) of the "
                f"{model.config.model_type} model are stored nowhere, e.g. {missing[0]}"
            )
        # and no stored tensor the model does not have (load_compressed's rule, read_dense)
        known = set(model.state_dict())
        extra = sorted(
            key for key in present - known if not key.startswith((*skip, TRANSFORMS_PREFIX))
        )
        if extra:
            raise ModelLoadError(
                f"{QUANT_METHOD} checkpoint: the dense weights hold {len(extra)} tensor(s) the "
                f"{model.config.model_type} model does not have, e.g. {extra[0]}"
            )

    def compare_manifest(self, directory: Path) -> dict[str, Any] | None:
        """``compression.json`` beside the weights, if any, checked as ``load_compressed``
        checks it (its ``dtype``, transforms and report well formed, and its loading entry equal
        to the config's: the other loaders read it, and both must build the same model);
        returned, or ``None`` where there is none."""
        from lmcompress.compressor.io.load import read_manifest

        if not (directory / MANIFEST).is_file():
            return None
        return read_manifest(directory)

    def check_stored_dtypes(self, model, layers: dict[str, Any], dtype_name: str) -> None:
        """Every stored floating tensor in the export's dtype, as ``load_compressed`` requires
        (a format's scales excepted): the loader would cast a float16 tensor of a float32
        export into the model's dtype without a word, hiding a tampered or foreign file. And
        every dense tensor of the shape ``config.json`` builds (one line, not transformers'
        size-mismatch traceback)."""
        from lmcompress.compressor.formats.catalog import format_class
        from lmcompress.compressor.io.load import key_renaming
        from lmcompress.compressor.model.loading import resolve_dtype

        dtype = resolve_dtype(dtype_name)
        for name, entry in layers.items():
            cls = format_class(entry["format"])
            tensors = {
                key: torch.empty(0, dtype=self.stored.header(f"{name}.{key}")[1], device="meta")
                for key in entry["tensors"]
                if f"{name}.{key}" in self.stored.headers
                and self.stored.header(f"{name}.{key}")[1].is_floating_point
            }  # an integer one: the schema's own message, from from_state below
            try:
                cls.schema.check_stored_dtypes(cls.format, tensors, dtype)
            except ModelLoadError as err:
                raise ModelLoadError(f"compressed layer {name}: {err}") from None
        rename, skip = key_renaming(model), tuple(f"{name}." for name in layers)
        expected = model.state_dict()
        for key in sorted(self.stored.files):
            target = expected.get(rename(key))
            stored = self.stored.header(key)[1]
            if key.startswith(skip) or target is None:
                continue
            shape = list(self.stored.header(key)[0])
            if shape != list(target.shape):  # transformers' own error is a traceback
                raise ModelLoadError(
                    f"{QUANT_METHOD} checkpoint: {rename(key)} is {shape} in the dense weights "
                    f"but {list(target.shape)} by config.json"
                )
            if target.is_floating_point() and stored != dtype:
                raise ModelLoadError(
                    f"{QUANT_METHOD} checkpoint: dense {rename(key)} is "
                    f"{str(stored).removeprefix('torch.')}, but the export's dtype is {dtype_name}"
                )

    def _process_model_after_weight_loading(self, model, **_):
        """Check the loaded values as ``from_state`` does; install the transforms."""
        from lmcompress.compressor.formats.base import check_finite
        from lmcompress.compressor.formats.catalog import format_class, transform_class
        from lmcompress.compressor.formats.int4_shared import prepare_decode
        from lmcompress.compressor.model import bf16_prefill

        skip = tuple(f"{name}." for name in self.quantization_config.compressed_layers)
        dense = {k: p for k, p in model.named_parameters() if not k.startswith(skip)}
        check_finite("dense", {k: p for k, p in dense.items() if p.is_floating_point()})
        for name, entry in self.quantization_config.compressed_layers.items():
            module = model.get_submodule(name)
            meta = {"conv1d": module.conv1d, **entry["meta"]}
            try:
                format_class(entry["format"]).from_state(module.state_tensors(), meta)
            except ModelLoadError as err:
                raise ModelLoadError(f"compressed layer {name}: {err}") from None
            if hasattr(module, "tile_codes"):  # int4: the decode kernel's layout, as replay's
                module.tile_codes()
        prepare_decode(model)  # as load_compressed's packed runtime
        bf16_prefill.install(model)
        device = next(model.parameters()).device
        for index, entry in enumerate(self.quantization_config.transforms):
            try:
                kind, meta, keys = entry["kind"], entry["meta"], entry["tensors"]
            except (KeyError, TypeError):
                raise ModelLoadError(f"{QUANT_METHOD}: malformed transform {index}") from None
            tensors = {
                key: self.stored.get(f"{TRANSFORMS_PREFIX}{index}.{key}", device) for key in keys
            }
            transform_class(kind).from_state(tensors, meta).install(model)
        return model

    def is_serializable(self) -> bool:
        return False  # save_compressed writes lmcompress's layout; save_pretrained cannot

    @property
    def is_trainable(self) -> bool:
        return False


class _MetaTensors:
    """``get_tensor(key)``: an empty tensor on the meta device of the stored shape, for
    :func:`~lmcompress.compressor.io.load.replay_layer`. Floating tensors take the model's dtype
    (the
    loader casts them to it), except a format's ``exact_tensors`` (scales), which keep theirs."""

    def __init__(self, stored: TensorFiles, layers: dict[str, Any], dtype: torch.dtype) -> None:
        from lmcompress.compressor.formats.catalog import format_class

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


def register() -> None:
    """Register the config and the quantizer with transformers under :data:`QUANT_METHOD`
    (once: a second call does nothing)."""
    if QUANT_METHOD not in auto.AUTO_QUANTIZATION_CONFIG_MAPPING:
        auto.register_quantization_config(QUANT_METHOD)(LmcompressConfig)
    if QUANT_METHOD not in auto.AUTO_QUANTIZER_MAPPING:
        auto.register_quantizer(QUANT_METHOD)(LmcompressHfQuantizer)
    logger.debug("registered the %s quantizer with transformers", QUANT_METHOD)
