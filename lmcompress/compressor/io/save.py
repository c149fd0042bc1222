"""Write compressed models (reading them back is :mod:`lmcompress.compressor.io.load`).

``save_compressed`` writes a directory with

- ``config.json`` + ``model.safetensors``: by default a dense copy that plain ``transformers``
  loads as a normal model (pruned weights as zeros, factorised layers multiplied out); with
  ``dense_copy=False`` only the parameters of the layers that are *not* compressed, plus
  ``lmcompress.safetensors.index.json`` and a ``quantization_config`` through which
  ``from_pretrained`` builds the compressed runtime after ``import lmcompress``;
- ``compressed.safetensors``: every compressed layer in its format's tensors, keyed
  ``<module>.<tensor>`` (packed N:M values and positions, low-rank factors, ...);
- ``compression.json``: method, config, report, package versions, format version, and per
  compressed layer its ``format``, the ``meta`` that rebuilds it, and its tensor names;
- ``README.md`` (the model card: method, options, perplexities, the command that reproduces
  the run, versions) and ``report.png`` (per-layer sparsity / rank / error, perplexity dense vs
  compressed), both drawn from the manifest alone.

The stored form of a layer is chosen by name from the registry (``runtime.FORMATS``): a layer
the method already replaced by a compressed module is stored as that module's tensors; a layer
whose report names a format (``LayerReport.format``) is encoded with that format's
``from_linear``. Everything is written into a temporary sibling directory that is renamed at
the end (``fsutil.atomic_dir``): a failed or interrupted save leaves no half-written output,
and the hidden ``.OUT.tmp-PID-HOST-*`` sibling a killed one (SIGKILL) leaves is removed by the
next save next to it. Every file gets the modes of an ordinary new file (safetensors' own are
0600).
"""

from __future__ import annotations

import json
import logging
import platform
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from lmcompress.compressor.formats.base import CompressedLinear, format_class, installed
from lmcompress.compressor.io.load import (  # noqa: F401  (the on-disk layout; re-exported)
    COMPRESSED_TENSORS,
    DENSE_TENSORS,
    FORMAT_VERSION,
    MANIFEST,
    STATS,
    load_compressed,
    read_manifest,
    runtime_bytes,
)
from lmcompress.compressor.io.model_card import MODEL_CARD, REPORT_PNG, model_card
from lmcompress.compressor.io.report_plot import write_report_png
from lmcompress.compressor.model.surgery import replace_modules
from lmcompress.compressor.report import CompressionReport
from lmcompress.compressor.util.fsutil import atomic_dir
from lmcompress.errors import LmcompressError

logger = logging.getLogger(__name__)


def _versions() -> dict[str, str]:
    import safetensors
    import transformers

    from lmcompress import __version__

    return {
        "python": platform.python_version(),
        "lmcompress": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "safetensors": safetensors.__version__,
    }


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
    dense_copy: bool = True,
) -> Path:
    """Save ``model`` (compressed in place by ``report``'s method) to ``out_dir``.

    Args:
        dtype: storage dtype of the weights and compressed tensors (floating ones only: packed
            positions stay uint8); ``None`` = the model's. The model itself is not changed.
        overwrite: replace an existing non-empty ``out_dir`` (only once the new one is complete).
        extra: more JSON-serialisable results to record in ``compression.json`` and show in
            the model card: the pipeline's ``checkpoint``, ``options``, ``dense`` /
            ``compressed`` perplexities, ``lm_eval`` and ``command``.
        stats: the method's :class:`Stats` (e.g. learned mask logits), saved as
            ``stats.safetensors`` when it holds tensors: for transfer and resuming.
        dense_copy: also write the compressed layers' dense weights into ``model.safetensors``
            so that plain ``transformers`` loads the directory. ``False`` writes only the
            parameters of the layers that are not compressed (plus ``config.json``): a smaller
            directory that :func:`load_compressed` reads, and ``from_pretrained`` too once
            ``lmcompress`` is imported (:mod:`lmcompress.compressor.io.hf_quantizer`).
    """
    out_dir = Path(out_dir)
    check_output_dir(out_dir, overwrite)
    dtype = dtype or next(model.parameters()).dtype
    compressed = compressed_modules(model, report)
    interop = {module.interop for module in compressed.values()}
    interop = interop.pop() if len(interop) == 1 and dense_copy else None
    if interop == "compressed-tensors" and any(m.conv1d for m in compressed.values()):
        logger.warning(
            "GPT-2's Conv1D layers have no compressed-tensors form: the dense copy holds "
            "the dequantized weights instead"
        )
        interop = None
    with atomic_dir(out_dir) as tmp:
        if interop == "compressed-tensors":  # the dense copy in the layout other tools read
            from lmcompress.compressor.io.compressed_tensors import write_compressed_tensors

            interop_config = write_compressed_tensors(model, tmp, compressed, dtype=dtype)
        else:
            interop, interop_config = None, None
            _write_weights(model, tmp, compressed, dtype, dense_copy)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        tensors: dict[str, torch.Tensor] = {}
        layouts: dict[str, dict[str, Any]] = {}
        for name, module in compressed.items():
            layer_tensors = {
                key: t.detach().cpu().contiguous()
                if key in module.exact_tensors
                else cast_tensor(t, dtype)
                for key, t in module.state_tensors().items()
            }
            tensors.update({f"{name}.{key}": value for key, value in layer_tensors.items()})
            layouts[name] = {
                "format": module.format,
                "meta": module.meta(),
                "tensors": sorted(layer_tensors),
            }
        transforms = []
        for index, transform in enumerate(installed(model)):
            stored = {
                k: t.detach().cpu().contiguous() for k, t in transform.state_tensors().items()
            }
            tensors.update({f"transforms.{index}.{key}": t for key, t in stored.items()})
            transforms.append(
                {"kind": transform.kind, "meta": transform.meta(), "tensors": sorted(stored)}
            )
        if tensors:
            save_file(
                tensors,
                str(tmp / COMPRESSED_TENSORS),
                metadata={"format_version": str(FORMAT_VERSION)},
            )
        if not dense_copy and tensors:  # from_pretrained builds the runtime (import lmcompress)
            from lmcompress.compressor.io.hf_quantizer import write_loading_entry

            write_loading_entry(tmp, layouts, transforms, sorted(tensors))
        manifest = {
            "format_version": FORMAT_VERSION,
            "method": report.method,
            "config": report.config,
            "dtype": str(dtype).removeprefix("torch."),
            "dense_copy": dense_copy,
            "interop": {"layout": interop, "quantization_config": interop_config}
            if interop
            else None,
            "versions": _versions(),
            "compressed_layers": layouts,
            "transforms": transforms,
            "results": extra or {},
            "report": report.to_dict(),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        # for a person: the card and the plots, from the manifest alone
        title = out_dir.resolve().name
        (tmp / MODEL_CARD).write_text(model_card(manifest, title), encoding="utf-8")
        write_report_png(manifest, tmp / REPORT_PNG)
        if stats is not None and stats.tensors:
            stats.save(tmp / STATS)
    logger.info("saved compressed model to %s", out_dir)
    return out_dir


def compressed_modules(model: nn.Module, report: CompressionReport) -> dict[str, CompressedLinear]:
    """``{name: compressed module}`` of every layer to store in a compressed format: the
    :class:`CompressedLinear` modules in the model (a method that replaced the layer), and the
    layers whose report names a format, encoded with that format's ``from_linear``."""
    found = {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, CompressedLinear)
    }
    for layer in report.layers:
        if layer.format is None or layer.name in found:
            continue
        module = model.get_submodule(layer.name)
        found[layer.name] = format_class(layer.format).from_linear(module, **layer.format_options)
    return found


def _write_weights(
    model: nn.Module,
    tmp: Path,
    compressed: dict[str, CompressedLinear],
    dtype: torch.dtype,
    dense_copy: bool,
) -> None:
    """``config.json`` and ``model.safetensors`` in ``dtype``, through ``save_pretrained``.

    For the dense copy, compressed modules standing in the model are swapped for their
    ``to_dense()`` layers while the state dict is taken, and swapped back even on error.
    """
    in_model = {
        name: module for name, module in compressed.items() if model.get_submodule(name) is module
    }
    swapped = {}
    try:
        if dense_copy:
            swapped = replace_modules(model, in_model, lambda _, module: module.to_dense())
            state = model.state_dict()
        else:
            skip = tuple(f"{name}." for name in compressed)
            state = {k: v for k, v in model.state_dict().items() if not k.startswith(skip)}
    finally:
        replace_modules(model, swapped, lambda name, _: in_model[name])
    model.save_pretrained(tmp, safe_serialization=True, state_dict=cast_state(state, dtype))
    config_file = tmp / "config.json"  # save_pretrained records the model's dtype, not ours
    config = json.loads(config_file.read_text())
    config["dtype"] = str(dtype).removeprefix("torch.")
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def cast_state(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``state`` with every tensor through :func:`cast_tensor`; tied weights (one storage
    under several keys) stay one tensor, so ``save_pretrained`` stores them once."""
    cast: dict[tuple, torch.Tensor] = {}
    out = {}
    for key, value in state.items():
        view = (value.untyped_storage().data_ptr(), value.storage_offset(), value.shape)
        if view not in cast:
            cast[view] = cast_tensor(value, dtype)
        out[key] = cast[view]
    return out


def cast_tensor(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """On the CPU, in ``dtype`` if floating point (integer codes keep theirs); no copy when
    nothing changes."""
    target = dtype if tensor.is_floating_point() else tensor.dtype
    return tensor.detach().to(device="cpu", dtype=target).contiguous()
