"""Read a directory written by :func:`~lmcompress.compressor.io.save.save_compressed`, by replay.

The model is rebuilt, not loaded and then patched: the skeleton comes from ``config.json`` with
its parameters on the meta device (no memory), every layer named in the manifest is replaced by
its compressed module built from the stored tensors (``format_class(fmt).from_state``), and only
then are the remaining parameters read from ``model.safetensors``, key by key. The dense weight
of a replaced layer is never read nor allocated, so a 2:4 model at fp16 holds its pruned
linears in 56 % of their dense bytes (``runtime="packed"``). ``runtime="dense"`` turns each
compressed module back into a plain ``nn.Linear`` / ``Conv1D`` afterwards (``to_dense()``): a
model that any code written for plain transformers models can use, rebuilt from the compressed
form, which is the source of truth in both runtimes.
"""

from __future__ import annotations

import json
from itertools import chain
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors import SafetensorError, safe_open
from torch import nn
from transformers.pytorch_utils import Conv1D

from lmcompress.compressor.formats.base import CompressedLinear, format_class, transform_class
from lmcompress.compressor.model.loading import _check_local_dir, _load_tokenizer, resolve_dtype
from lmcompress.compressor.model.surgery import in_out_features, is_linear, replace_modules
from lmcompress.compressor.report import CompressionReport
from lmcompress.errors import ConfigError, ModelLoadError

# The on-disk layout (shared with export.py).
FORMAT_VERSION = 2  # 2: compressed_layers[name] = {"format", "meta", "tensors"}; 1: nm_packed only
READABLE_VERSIONS = (1, 2)
MANIFEST = "compression.json"
COMPRESSED_TENSORS = "compressed.safetensors"
DENSE_TENSORS = "model.safetensors"
STATS = "stats.safetensors"
RUNTIMES = ("packed", "dense")


def read_manifest(out_dir: str | Path) -> dict[str, Any]:
    """``compression.json``, checked, with version-1 layer entries rewritten in today's form."""
    path = Path(out_dir) / MANIFEST
    if not path.is_file():
        raise ModelLoadError(f"{out_dir} is not an lmcompress output directory (no {MANIFEST})")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ModelLoadError(f"{path} is not valid JSON: {err}") from None
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if version not in READABLE_VERSIONS:
        raise ModelLoadError(
            f"{path}: unsupported format_version {version!r} (this lmcompress reads "
            f"{', '.join(map(str, READABLE_VERSIONS))})"
        )
    manifest["compressed_layers"] = check_layers(
        manifest.get("compressed_layers", {}), version, str(path)
    )
    return manifest


def check_layers(layers: Any, version: int, where: str) -> dict[str, dict[str, Any]]:
    """``compressed_layers`` checked (each entry a ``format`` name, a ``meta`` dict and tensor
    names), version-1 entries rewritten in today's form; a :class:`ModelLoadError` naming
    ``where`` otherwise. Shared by the manifest and the ``quantization_config`` of a compact
    export (:mod:`lmcompress.compressor.io.hf_quantizer`)."""
    try:
        if version == 1:
            layers = {name: _upgrade_v1(entry) for name, entry in layers.items()}
        for name, entry in layers.items():
            if not (isinstance(entry["format"], str) and isinstance(entry["meta"], dict)):
                raise TypeError(f"bad entry for {name}")
            entry["tensors"] = [str(key) for key in entry["tensors"]]
    except (AttributeError, KeyError, TypeError, ValueError) as err:
        raise ModelLoadError(f"{where}: malformed compressed_layers ({err})") from None
    return layers


def _upgrade_v1(entry: dict[str, Any]) -> dict[str, Any]:
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


def load_compressed(
    out_dir: str | Path, runtime: str = "dense", device: str | torch.device = "cpu"
) -> tuple[nn.Module, Any, CompressionReport]:
    """Load a directory written by ``save_compressed``: ``(model, tokenizer, report)``.

    Args:
        runtime: ``"packed"`` keeps every compressed layer in its compressed module
            (``PackedNMLinear``, ``LowRankLinear``, ...); ``"dense"`` gives plain linear layers
            rebuilt from the compressed form (the default: what code written for plain
            transformers models, including another compression run, expects).
        device: where the model lives; tensors are read from disk straight onto it.

    Works without the dense copy (``save_compressed(..., dense_copy=False)``). Raises
    :class:`ConfigError` for an unknown runtime, :class:`ModelLoadError` for a missing,
    corrupt or foreign directory, or a format this version does not know.
    """
    if runtime not in RUNTIMES:
        raise ConfigError(f"unknown runtime {runtime!r}; choose one of {', '.join(RUNTIMES)}")
    out_dir = Path(out_dir)
    manifest = read_manifest(out_dir)
    model = build_model(out_dir, manifest, device)
    if runtime == "dense":
        replace_modules(model, manifest["compressed_layers"], lambda _, module: module.to_dense())
    transforms = manifest.get("transforms", [])  # e.g. an 8-bit softmax
    if transforms:
        with _open(out_dir / COMPRESSED_TENSORS, device) as packed:
            for index, entry in enumerate(transforms):
                try:
                    tensors = {
                        k: packed.get_tensor(f"transforms.{index}.{k}") for k in entry["tensors"]
                    }
                except SafetensorError as err:
                    raise ModelLoadError(
                        f"{out_dir}: transform {entry['kind']} is incomplete: {err}"
                    ) from None
                transform_class(entry["kind"]).from_state(tensors, entry["meta"]).install(model)
    tokenizer = _load_tokenizer(str(out_dir), False, {"trust_remote_code": False})
    return model, tokenizer, CompressionReport.from_dict(manifest["report"])


def build_model(
    out_dir: Path, manifest: dict[str, Any], device: str | torch.device = "cpu"
) -> nn.Module:
    """The packed-runtime model: skeleton on meta, compressed layers replayed, the rest read."""
    _check_local_dir(out_dir)  # config.json of a supported family, some safetensors
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ConfigError(f"unknown device {device!r}: {err}") from None
    try:
        config = transformers.AutoConfig.from_pretrained(out_dir)
    except (OSError, ValueError, KeyError) as err:
        raise ModelLoadError(f"{out_dir}: unreadable config: {_first_line(err)}") from None
    # A dense copy in another tool's quantized layout (compressed-tensors) says so in its
    # config; the skeleton is built plain and the compressed layers are replayed from our file.
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config
    dtype = resolve_dtype(manifest["dtype"])
    import accelerate

    # Parameters on meta; buffers computed at init (rotary inv_freq, causal masks) stay real.
    with accelerate.init_empty_weights(include_buffers=False):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    dense = _DenseTensors(out_dir, device, model)
    layers = manifest["compressed_layers"]
    for name in layers:
        try:
            model.get_submodule(name)
        except AttributeError:
            raise ModelLoadError(
                f"{out_dir}: compressed layer {name} is not in the {config.model_type} model"
            ) from None
    if layers:
        with _open(out_dir / COMPRESSED_TENSORS, device) as packed:
            replace_modules(
                model,
                layers,
                lambda name, old: replay_layer(name, old, layers[name], packed, dense),
            )
    # Every parameter and persistent buffer not under a replaced layer, and only those keys.
    skip = tuple(f"{name}." for name in layers)
    wanted = [key for key in model.state_dict(keep_vars=True) if not key.startswith(skip)]
    model.load_state_dict(dense.read(wanted), strict=False, assign=True)
    model.tie_weights()  # SmolLM2's head shares the embeddings, which the file holds once
    leftover = [
        name
        for name, tensor in chain(model.named_parameters(), model.named_buffers())
        if tensor.is_meta
    ]
    if leftover:
        raise ModelLoadError(
            f"{out_dir}: {len(leftover)} tensors are stored nowhere, e.g. {leftover[0]}"
        )
    try:
        model.generation_config = transformers.GenerationConfig.from_pretrained(out_dir)
    except OSError:
        pass  # no generation_config.json: keep the one derived from config.json
    return model.to(device).eval()


def replay_layer(
    name: str, old: nn.Module, entry: dict[str, Any], packed, dense: _DenseTensors | None
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
    new = format_class(entry["format"]).from_state(tensors, meta)
    if (new.in_features, new.out_features) != in_out_features(old):
        raise ModelLoadError(
            f"compressed layer {name} is {new.out_features}x{new.in_features}, the model's "
            f"{in_out_features(old)[::-1]}"
        )
    return new


class _DenseTensors:
    """Key-by-key reads from ``model.safetensors`` (or its shards), under the model's names.

    ``save_pretrained`` writes some families' keys in their original checkpoint names
    (GPT-NeoX's head is ``embed_out``, the model's ``lm_head``); ``from_pretrained`` renames them
    back on load, and so does this, with transformers' own renaming table.
    """

    def __init__(self, out_dir: Path, device: torch.device, model: nn.Module) -> None:
        self.device = device
        index = out_dir / f"{DENSE_TENSORS}.index.json"
        try:
            if index.is_file():
                weight_map = json.loads(index.read_text())["weight_map"]
                files = {key: out_dir / file for key, file in weight_map.items()}
            elif (out_dir / DENSE_TENSORS).is_file():
                with _open(out_dir / DENSE_TENSORS, device) as f:
                    files = dict.fromkeys(f.keys(), out_dir / DENSE_TENSORS)
            else:
                files = {}
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as err:
            raise ModelLoadError(f"{index}: malformed index ({err})") from None
        rename = _key_renaming(model)
        self.files = {rename(key): (path, key) for key, path in files.items()}

    def get(self, key: str) -> torch.Tensor:
        if key not in self.files:
            raise ModelLoadError(f"{key} is missing from {DENSE_TENSORS}")
        return self.read([key])[key]

    def read(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """The stored tensors among ``keys`` (others are skipped), each file opened once."""
        by_file: dict[Path, list[tuple[str, str]]] = {}
        for key in keys:
            if key in self.files:
                path, stored = self.files[key]
                by_file.setdefault(path, []).append((key, stored))
        tensors = {}
        for path, pairs in by_file.items():
            with _open(path, self.device) as f:
                tensors.update({key: f.get_tensor(stored) for key, stored in pairs})
        return tensors


def _key_renaming(model: nn.Module):
    """``checkpoint key -> model key`` as ``from_pretrained`` renames (identity on transformers
    versions without a renaming table, which also save under the model's names)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key
    except ImportError:
        return lambda key: key
    renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    return lambda key: rename_source_key(key, renamings, [])[0]


class _open:
    """``safe_open`` whose failures (missing, truncated, not safetensors) are one-line
    :class:`ModelLoadError`s."""

    def __init__(self, path: Path, device: torch.device) -> None:
        self.path, self.device = path, device

    def __enter__(self):
        try:
            self.handle = safe_open(str(self.path), framework="pt", device=str(self.device))
            return self.handle.__enter__()
        except (SafetensorError, OSError) as err:
            raise ModelLoadError(f"cannot read {self.path}: {_first_line(err)}") from None

    def __exit__(self, *exc) -> None:
        self.handle.__exit__(*exc)


def runtime_bytes(model: nn.Module, names: list[str] | None = None) -> dict[str, Any]:
    """Bytes that the weights of the compressed layers occupy in memory, next to their dense
    fp16 bytes: the claim of a compressed runtime, measured on the loaded model.

    ``names``: the layers to count (default: every :class:`CompressedLinear` in ``model``); in a
    dense-runtime model pass the manifest's layer names. Counts every tensor a layer holds
    except its bias (values and positions, factors, scales), each storage once.
    """
    if names is None:
        names = [n for n, m in model.named_modules() if isinstance(m, CompressedLinear)]
    resident = dense_fp16 = 0
    seen: set[tuple[str, int]] = set()
    for name in names:
        module = model.get_submodule(name)
        for key, tensor in chain(module.named_parameters(), module.named_buffers()):
            storage = (str(tensor.device), tensor.untyped_storage().data_ptr())
            if key.rpartition(".")[2] == "bias" or storage in seen:
                continue
            seen.add(storage)
            resident += tensor.untyped_storage().nbytes()
        if isinstance(module, CompressedLinear):
            shape = (module.in_features, module.out_features)
        else:
            shape = in_out_features(module)
        dense_fp16 += shape[0] * shape[1] * 2
    return {
        "layers": len(names),
        "resident_bytes": resident,
        "dense_fp16_bytes": dense_fp16,
        "ratio_to_dense_fp16": resident / dense_fp16 if dense_fp16 else None,
    }


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
