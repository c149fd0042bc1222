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
import logging
from collections.abc import Callable
from itertools import chain
from pathlib import Path
from typing import Any

import accelerate
import torch
import transformers
from safetensors import SafetensorError
from torch import nn

from lmcompress.compressor.formats.base import CompressedLinear, check_finite
from lmcompress.compressor.formats.catalog import transform_class
from lmcompress.compressor.formats.int4_shared import prepare_decode
from lmcompress.compressor.formats.schema import FLOAT_NAMES
from lmcompress.compressor.io.layout import (
    COMPRESSED_TENSORS,
    MANIFEST,
    QUANT_METHOD,
    READABLE_VERSIONS,
    TRANSFORMS_PREFIX,
)
from lmcompress.compressor.io.replay import (
    check_layers,
    check_transforms,
    check_unlisted,
    compare_manifests,
    replay_layer,
    stored_keys,
)
from lmcompress.compressor.io.shards import TensorFiles, open_safetensors
from lmcompress.compressor.model import bf16_prefill
from lmcompress.compressor.model.checkpoint import LOAD_ERRORS, check_local_dir, config_error
from lmcompress.compressor.model.loading import check_device, load_tokenizer, resolve_dtype
from lmcompress.compressor.model.structure import apply_widths_
from lmcompress.compressor.model.surgery import in_out_features, is_linear, replace_modules
from lmcompress.compressor.report import CompressionReport
from lmcompress.compressor.util.arguments import path_argument
from lmcompress.errors import ConfigError, ModelLoadError, first_line, shown

logger = logging.getLogger(__name__)

try:  # transformers >= 5: the table from_pretrained renames checkpoint keys with
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key
except ImportError:  # older versions save and load under the model's own names
    get_model_conversion_mapping = None

RUNTIMES = ("packed", "dense", "expanded")


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
    check_manifest(manifest, Path(out_dir), str(path))
    return manifest


def check_manifest(manifest: dict[str, Any], out_dir: Path, where: str) -> None:
    """The fields of ``compression.json`` a loader reads, each of its type: ``dtype``, the
    transforms, the report; and ``config.json``'s copy of the loading entry (a compact
    export's ``quantization_config``, which ``from_pretrained`` reads) equal to it."""
    if manifest.get("dtype") not in FLOAT_NAMES:
        raise ModelLoadError(f"{where}: dtype is {shown(manifest.get('dtype'))}")
    transforms = check_transforms(manifest.setdefault("transforms", []), where)
    report = manifest.get("report")
    try:
        if not (isinstance(report, dict) and isinstance(report.get("layers", []), list)):
            raise TypeError("not an object with a list of layers")
        CompressionReport.from_dict(report)
    except (AttributeError, KeyError, TypeError, ValueError) as err:
        raise ModelLoadError(f"{where}: malformed report ({first_line(err)})") from None
    try:
        config = json.loads((out_dir / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return  # check_local_dir says what is wrong with it
    copy = config.get("quantization_config") if isinstance(config, dict) else None
    ours = isinstance(copy, dict) and copy.get("quant_method") == QUANT_METHOD
    compact = manifest.get("dense_copy") is False
    if ours or compact and stored_keys(manifest["compressed_layers"], transforms):
        compare_manifests(copy if ours else None, manifest["compressed_layers"], transforms, where)


def load_compressed(
    out_dir: str | Path, runtime: str = "dense", device: str | torch.device = "cpu"
) -> tuple[nn.Module, Any, CompressionReport]:
    """Load a directory written by ``save_compressed``: ``(model, tokenizer, report)``.

    Args:
        runtime: ``"packed"`` keeps every compressed layer in its compressed module
            (``PackedNMLinear``, ``LowRankLinear``, ...); ``"dense"`` gives plain linear layers
            rebuilt from the compressed form (the default: what code written for plain
            transformers models, including another compression run, expects);
            ``"expanded"`` unpacks packed layers once, for speed, at the memory that costs
            (:meth:`~lmcompress.compressor.formats.base.CompressedLinear.expanded`; logged).
            In every runtime a bf16 model's plain linears compute prefill in float32 on a CPU
            that emulates bf16 matmuls, as its compressed layers do
            (:mod:`~lmcompress.compressor.model.bf16_prefill`).
        device: where the model lives; tensors are read from disk straight onto it.

    Works without the dense copy (``save_compressed(..., dense_copy=False)``). Raises
    :class:`ConfigError` for an unknown runtime, :class:`ModelLoadError` for a missing,
    corrupt or foreign directory, or a format this version does not know.
    """
    out_dir = Path(path_argument("out_dir", out_dir))
    if not isinstance(runtime, str) or runtime not in RUNTIMES:
        raise ConfigError(f"unknown runtime {shown(runtime)}; choose one of {', '.join(RUNTIMES)}")
    device = check_device(device)  # cuda without a GPU: one line, before reading anything
    manifest = read_manifest(out_dir)
    model = build_model(out_dir, manifest, device)
    if runtime == "dense":
        # in the export's dtype: an int8 layer dequantizes to its meta ``dtype``, that of the
        # model it was compressed from, which a save in another dtype does not change
        dtype = resolve_dtype(manifest["dtype"])
        replace_modules(
            model, manifest["compressed_layers"], lambda _, module: module.to_dense().to(dtype)
        )
    elif runtime == "expanded":
        expand(model, list(manifest["compressed_layers"]), resolve_dtype(manifest["dtype"]))
    else:
        prepare_decode(model)  # int4: siblings share a decode call; huge pages
    bf16_prefill.install(model)  # plain bf16 linears: prefill in float32 where bf16 is emulated
    transforms = manifest.get("transforms", [])  # e.g. an 8-bit softmax
    if transforms:
        with open_safetensors(out_dir / COMPRESSED_TENSORS, device) as packed:
            for index, entry in enumerate(transforms):
                try:
                    tensors = {
                        k: packed.get_tensor(f"{TRANSFORMS_PREFIX}{index}.{k}")
                        for k in entry["tensors"]
                    }
                except SafetensorError as err:
                    raise ModelLoadError(
                        f"{out_dir}: transform {entry['kind']} is incomplete: {err}"
                    ) from None
                transform_class(entry["kind"]).from_state(tensors, entry["meta"]).install(model)
    tokenizer = load_tokenizer(str(out_dir), False, {"trust_remote_code": False})
    return model, tokenizer, CompressionReport.from_dict(manifest["report"])  # checked


def expand(model: nn.Module, names: list[str], dtype: torch.dtype | None = None) -> None:
    """The ``expanded`` runtime: each compressed layer replaced by its ``expanded()`` module
    (one that comes out a plain linear in the export's ``dtype``, as the dense runtime's: an
    int4 layer's dense weight has the dtype it was compressed in, which a save in another
    dtype does not change); logs what it costs in memory."""
    before = runtime_bytes(model, names)["resident_bytes"]

    def expanded(_name: str, module: CompressedLinear) -> nn.Module:
        new = module.expanded()
        return new.to(dtype) if dtype is not None and is_linear(new) else new

    replace_modules(model, names, expanded)
    after = runtime_bytes(model, names)["resident_bytes"]
    logger.info(
        "expanded runtime: %d compressed layers hold %.1f MiB, %+.1f MiB over the packed form",
        len(names),
        after / 2**20,
        (after - before) / 2**20,
    )


def build_model(
    out_dir: Path, manifest: dict[str, Any], device: str | torch.device = "cpu"
) -> nn.Module:
    """The packed-runtime model: skeleton on meta, compressed layers replayed, the rest read."""
    check_local_dir(out_dir)  # config.json of a supported family, some safetensors
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ConfigError(f"unknown device {device!r}: {err}") from None
    try:
        config = transformers.AutoConfig.from_pretrained(out_dir)
    except LOAD_ERRORS as err:
        raise ModelLoadError(f"{out_dir}: unreadable config: {config_error(err)}") from None
    # A dense copy in another tool's quantized layout (compressed-tensors) says so in its
    # config; the skeleton is built plain and the compressed layers are replayed from our file.
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config
    dtype = resolve_dtype(manifest["dtype"])
    # Parameters on meta; buffers computed at init (rotary inv_freq, causal masks) stay real.
    try:
        with accelerate.init_empty_weights(include_buffers=False):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    except (ValueError, TypeError, RuntimeError) as err:
        raise ModelLoadError(f"{out_dir}: config.json builds no model: {first_line(err)}") from None
    try:
        apply_widths_(model)  # a structured export with per-layer widths
    except (ConfigError, ModelLoadError) as err:
        raise ModelLoadError(f"{out_dir}: {first_line(err)}") from None
    dense = TensorFiles.of_checkpoint(out_dir, device, key_renaming(model))
    skeleton = set(model.state_dict())
    replay_layers(model, out_dir, manifest, dense, device)
    # Every parameter and persistent buffer not under a replaced layer, and only those keys.
    stored = read_dense(model, out_dir, manifest, dense, skeleton)
    model.load_state_dict(stored, strict=False, assign=True)
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


def replay_layers(
    model: nn.Module,
    out_dir: Path,
    manifest: dict[str, Any],
    dense: TensorFiles,
    device: torch.device,
) -> None:
    """Replace every layer the manifest names by its compressed module, from
    ``compressed.safetensors``, which must hold the listed tensors and no other."""
    layers, dtype = manifest["compressed_layers"], resolve_dtype(manifest["dtype"])
    for name in layers:
        try:
            model.get_submodule(name)
        except AttributeError:
            raise ModelLoadError(
                f"{out_dir}: compressed layer {name} is not in the {model.config.model_type} model"
            ) from None
    listed = stored_keys(layers, manifest["transforms"])
    path = out_dir / COMPRESSED_TENSORS
    if not listed and not path.exists():
        return
    with open_safetensors(path, device) as packed:
        check_unlisted(set(packed.keys()), listed, str(path))
        replace_modules(
            model,
            layers,
            lambda name, old: replay_layer(name, old, layers[name], packed, dense, dtype),
        )


def read_dense(
    model: nn.Module,
    out_dir: Path,
    manifest: dict[str, Any],
    dense: TensorFiles,
    skeleton: set[str],
) -> dict[str, torch.Tensor]:
    """The dense part: every tensor of ``model`` not under a replaced layer, checked as the
    compressed ones are: the shape ``config.json`` builds, floating ones in the export's dtype
    and finite, and no stored tensor that the skeleton (keys ``skeleton``) does not have."""
    skip = tuple(f"{name}." for name in manifest["compressed_layers"])
    # a replaced layer's dense form (compressed-tensors: codes and scales) is another tool's
    if extra := sorted(k for k in set(dense.files) - skeleton if not k.startswith(skip)):
        raise ModelLoadError(
            f"{out_dir}: the dense weights hold {len(extra)} tensor(s) the "
            f"{model.config.model_type} model of config.json does not have, e.g. {extra[0]}"
        )
    expected = {k: t for k, t in model.state_dict(keep_vars=True).items() if not k.startswith(skip)}
    tensors = dense.read(expected)
    dtype = resolve_dtype(manifest["dtype"])
    for key, tensor in tensors.items():
        if tensor.shape != expected[key].shape:
            raise ModelLoadError(
                f"{out_dir}: {key} is {list(tensor.shape)} in the dense weights but "
                f"{list(expected[key].shape)} by config.json"
            )
        if expected[key].is_floating_point() and tensor.dtype != dtype:
            raise ModelLoadError(
                f"{out_dir}: dense {key} is {str(tensor.dtype).removeprefix('torch.')}, but "
                f"the export's dtype is {manifest['dtype']}"
            )
    try:
        check_finite("dense", {k: t for k, t in tensors.items() if t.is_floating_point()})
    except ModelLoadError as err:
        raise ModelLoadError(f"{out_dir}: {err}") from None
    return tensors


def key_renaming(model: nn.Module) -> Callable[[str], str]:
    """``checkpoint key -> model key`` as ``from_pretrained`` renames (identity on transformers
    versions without a renaming table, which also save under the model's names)."""
    if get_model_conversion_mapping is None:
        return str
    renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    return lambda key: rename_source_key(key, renamings, [])[0]


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
