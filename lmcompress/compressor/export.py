"""Write and read compressed models.

``save_compressed`` writes a directory that plain ``transformers`` loads as a normal model
(pruned weights are stored as dense zeros), plus

- ``compressed.safetensors``: the compressed forms, e.g. the packed N:M values and positions of
  every pruned layer (``lmcompress.kernels.reference``), keyed ``<module>.<tensor>``;
- ``compression.json``: method, config, report, package versions, format version, and for each
  compressed layer how its tensors are encoded.

``load_compressed`` loads the dense model, then rebuilds every compressed layer from its
compressed form, so the packed form is the source of truth and round-trips bit-exactly.
Everything is written into a temporary sibling directory that is renamed at the end: a failed
save leaves no half-written output.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from lmcompress.compressor.config import parse_sparsity
from lmcompress.compressor.models import load_model
from lmcompress.compressor.report import CompressionReport, LayerReport
from lmcompress.compressor.surgery import weight_matrix
from lmcompress.errors import LmcompressError, ModelLoadError
from lmcompress.kernels.reference import pack_nm, unpack_nm

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = "compression.json"
COMPRESSED_TENSORS = "compressed.safetensors"
STATS = "stats.safetensors"


def _versions() -> dict[str, str]:
    import safetensors
    import transformers

    from lmcompress import __version__

    return {
        "lmcompress": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "safetensors": safetensors.__version__,
    }


# --- per-layer formats --------------------------------------------------------------------
# A format turns one compressed layer into tensors + JSON metadata and back. New compressed
# forms (low-rank pairs, int8 + scales) add an encoder/decoder pair here.


def _encode_layer(
    module: nn.Module, layer: LayerReport, dtype: torch.dtype
) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
    if layer.pattern is None or ":" not in layer.pattern:
        return None  # unstructured: the dense zeros are the stored form
    sparsity = parse_sparsity(layer.pattern)
    values, indices = pack_nm(
        weight_matrix(module).detach().to(dtype).cpu(), sparsity.n, sparsity.m
    )
    meta = {"format": "nm_packed", "n": sparsity.n, "m": sparsity.m, "shape": list(layer.shape)}
    return {"values": values, "indices": indices}, meta


@torch.no_grad()
def _decode_layer(
    module: nn.Module, tensors: dict[str, torch.Tensor], meta: dict[str, Any]
) -> None:
    if meta.get("format") != "nm_packed":
        raise ModelLoadError(f"unknown compressed format {meta.get('format')!r}")
    out_features, in_features = meta["shape"]
    dense = unpack_nm(tensors["values"], tensors["indices"], meta["n"], meta["m"], in_features)
    target = weight_matrix(module)
    if tuple(target.shape) != (out_features, in_features):
        raise ModelLoadError(
            f"compressed layer shape {meta['shape']} != model {list(target.shape)}"
        )
    target.copy_(dense.to(device=target.device, dtype=target.dtype))


# --- save ---------------------------------------------------------------------------------


def check_output_dir(out_dir: str | Path, overwrite: bool = False) -> None:
    """Refuse a path that is a file, or a non-empty directory unless ``overwrite``."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise LmcompressError(f"output path {out_dir} exists and is not a directory")
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise LmcompressError(f"output directory {out_dir} is not empty (use --overwrite)")


def save_compressed(
    model: nn.Module,
    out_dir: str | Path,
    report: CompressionReport,
    tokenizer: Any = None,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
    extra: dict[str, Any] | None = None,
    stats: Any = None,
) -> Path:
    """Save ``model`` (compressed in place by ``report``'s method) to ``out_dir``.

    Args:
        dtype: storage dtype of the weights and compressed values; ``None`` = the model's.
        overwrite: replace an existing non-empty ``out_dir`` (only once the new one is complete).
        extra: more JSON-serialisable results to record in ``compression.json`` (perplexities).
        stats: the method's :class:`Stats` (e.g. learned mask logits), saved as
            ``stats.safetensors`` when it holds tensors: for transfer and resuming.
    """
    out_dir = Path(out_dir)
    check_output_dir(out_dir, overwrite)
    dtype = dtype or next(model.parameters()).dtype
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; the output is an ordinary directory
    try:
        _write(model, tmp, report, tokenizer, dtype, extra or {})
        if stats is not None and stats.tensors:
            stats.save(tmp / STATS)
        if out_dir.exists():
            trash = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            os.replace(out_dir, trash / "old")
            os.replace(tmp, out_dir)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("saved compressed model to %s", out_dir)
    return out_dir


def _write(model, tmp: Path, report, tokenizer, dtype: torch.dtype, extra: dict) -> None:
    model_dtype = next(model.parameters()).dtype
    if dtype != model_dtype:
        model.to(dtype)  # save_pretrained writes parameters in their own dtype
    try:
        model.save_pretrained(tmp, safe_serialization=True)
    finally:
        if dtype != model_dtype:
            model.to(model_dtype)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)

    tensors: dict[str, torch.Tensor] = {}
    layouts: dict[str, dict[str, Any]] = {}
    for layer in report.layers:
        encoded = _encode_layer(model.get_submodule(layer.name), layer, dtype)
        if encoded is None:
            continue
        layer_tensors, meta = encoded
        tensors.update({f"{layer.name}.{key}": value for key, value in layer_tensors.items()})
        layouts[layer.name] = {**meta, "tensors": sorted(layer_tensors)}
    if tensors:
        save_file(
            tensors, str(tmp / COMPRESSED_TENSORS), metadata={"format_version": str(FORMAT_VERSION)}
        )
    manifest = {
        "format_version": FORMAT_VERSION,
        "method": report.method,
        "config": report.config,
        "dtype": str(dtype).removeprefix("torch."),
        "versions": _versions(),
        "compressed_layers": layouts,
        "results": extra,
        "report": report.to_dict(),
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


# --- load ---------------------------------------------------------------------------------


def read_manifest(out_dir: str | Path) -> dict[str, Any]:
    path = Path(out_dir) / MANIFEST
    if not path.is_file():
        raise ModelLoadError(f"{out_dir} is not an lmcompress output directory (no {MANIFEST})")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ModelLoadError(f"{path} is not valid JSON: {err}") from None
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if version != FORMAT_VERSION:
        raise ModelLoadError(
            f"{path}: unsupported format_version {version!r} (expected {FORMAT_VERSION})"
        )
    return manifest


def load_compressed(
    out_dir: str | Path, device: str | torch.device = "cpu"
) -> tuple[nn.Module, Any, CompressionReport]:
    """Load a directory written by :func:`save_compressed`: (model, tokenizer, report)."""
    out_dir = Path(out_dir)
    manifest = read_manifest(out_dir)
    model, tokenizer = load_model(str(out_dir), dtype=manifest["dtype"], device=device)
    layouts = manifest.get("compressed_layers", {})
    if layouts:
        try:
            tensors = load_file(str(out_dir / COMPRESSED_TENSORS))
        except (SafetensorError, OSError) as err:
            raise ModelLoadError(f"cannot read {out_dir / COMPRESSED_TENSORS}: {err}") from None
        for name, meta in layouts.items():
            try:
                module = model.get_submodule(name)
                layer_tensors = {key: tensors[f"{name}.{key}"] for key in meta["tensors"]}
            except (AttributeError, KeyError) as err:
                raise ModelLoadError(
                    f"{out_dir}: compressed layer {name} is incomplete ({err})"
                ) from None
            _decode_layer(module, layer_tensors, meta)
    return model, tokenizer, CompressionReport.from_dict(manifest["report"])
