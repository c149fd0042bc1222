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

The stored form of a layer is chosen by name from the format catalog: a layer
the method already replaced by a compressed module is stored as that module's tensors; a layer
whose report names a format (``LayerReport.format``) is encoded with that format's
``from_linear``. Everything is written into a temporary sibling directory that is renamed at
the end (:meth:`OutputDir.build`): a failed or interrupted save leaves no half-written output,
and the hidden ``.OUT.tmp-PID-HOST-*`` sibling a killed one (SIGKILL) leaves is removed by the
next save next to it. Every file gets the modes of an ordinary new file (safetensors' own are
0600).

One save path: a model in memory (:func:`save_compressed`) and a model streamed block by block
(:mod:`lmcompress.jobs.streaming`) both pack their compressed layers, describe the directory and
write the card through :class:`Export`; only where the dense weights come from differs
(``save_pretrained`` of the whole model, or one shard per block).
"""

from __future__ import annotations

import json
import logging
import platform
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import safetensors
import torch
import transformers
from safetensors.torch import save_file
from torch import nn

from lmcompress.compressor.formats.base import CompressedLinear, ModelTransform, installed
from lmcompress.compressor.formats.catalog import format_class
from lmcompress.compressor.io import gguf_export
from lmcompress.compressor.io.compressed_tensors import refusal as compressed_tensors_refusal
from lmcompress.compressor.io.compressed_tensors import write_compressed_tensors
from lmcompress.compressor.io.layout import (
    COMPRESSED_TENSORS,
    FORMAT_VERSION,
    MANIFEST,
    MODEL_CARD,
    QUANT_METHOD,
    REPORT_PNG,
    STATS,
    TRANSFORMS_PREFIX,
    WEIGHTS_INDEX,
    update_config_json,
)
from lmcompress.compressor.io.model_card import model_card
from lmcompress.compressor.io.output import OutputDir
from lmcompress.compressor.io.report_plot import write_report_png
from lmcompress.compressor.io.shards import TensorFiles, cast_state, cast_tensor, merge_safetensors
from lmcompress.compressor.model.surgery import replace_modules
from lmcompress.compressor.report import CompressionReport, LayerReport
from lmcompress.compressor.util.arguments import path_argument, require
from lmcompress.errors import ConfigError
from lmcompress.version import __version__

logger = logging.getLogger(__name__)

PARTS = ".compressed-parts"  # per-block compressed tensors of a streamed export, merged at the end


def versions() -> dict[str, str]:
    """The versions an export records (and its model card shows)."""
    return {
        "python": platform.python_version(),
        "lmcompress": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "safetensors": safetensors.__version__,
    }


def save_compressed(
    model: nn.Module,
    out_dir: str | Path | OutputDir,
    report: CompressionReport,
    tokenizer: Any = None,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
    extra: dict[str, Any] | None = None,
    stats: Any = None,
    dense_copy: bool = True,
    exports: Sequence[str] = (),
) -> Path:
    """Save ``model`` (compressed in place by ``report``'s method) to ``out_dir``.

    Args:
        out_dir: a path, or a job's :class:`OutputDir` (checked already: not again).
        dtype: storage dtype of the weights and compressed tensors (floating ones only: packed
            positions stay uint8); ``None`` = the model's. The model itself is not changed.
        overwrite: replace an existing non-empty ``out_dir`` (only once the new one is
            complete); an :class:`OutputDir` brings its own.
        extra: more JSON-serialisable results to record in ``compression.json`` and show in
            the model card: the job's ``checkpoint``, ``options``, ``dense`` /
            ``compressed`` perplexities, ``lm_eval`` and ``command``.
        stats: the method's :class:`Stats` (e.g. learned mask logits), saved as
            ``stats.safetensors`` when it holds tensors: for transfer and resuming.
        dense_copy: also write the compressed layers' dense weights into ``model.safetensors``
            so that plain ``transformers`` loads the directory. ``False`` writes only the
            parameters of the layers that are not compressed (plus ``config.json``): a smaller
            directory that :func:`load_compressed` reads, and ``from_pretrained`` too once
            ``lmcompress`` is imported (:mod:`lmcompress.compressor.io.hf_quantizer`).
        exports: other engines' files to write too: ``"gguf"`` writes ``model.gguf``
            (:mod:`~lmcompress.compressor.io.gguf_export`; refused in one line before anything
            is written when the model or its layers have no GGUF form), recorded as
            ``results["gguf"]``.
    """
    require("model", model, nn.Module, "a torch.nn.Module (a transformers model)")
    require("report", report, CompressionReport, "the CompressionReport that compress returned")
    if not isinstance(out_dir, OutputDir):
        out_dir = path_argument("out_dir", out_dir)
    output = OutputDir.of(out_dir, overwrite).check()
    dtype = dtype or next(model.parameters()).dtype
    compressed = compressed_modules(model, report.layers)
    interop = interop_layout(compressed, dense_copy)
    extra = {} if extra is None else extra  # the caller's results: gets results["gguf"]
    unknown = sorted(set(exports) - {"gguf"})
    if unknown:
        raise ConfigError(f"unknown export {unknown[0]!r}: gguf is the one there is")
    if "gguf" in exports and (why := gguf_export.refusal(model.config, compressed)):
        raise ConfigError(why)
    with output.build() as tmp:
        export = Export(tmp, output.path.resolve().name, dtype, dense_copy)
        interop_config = None
        if interop == "compressed-tensors":  # the dense copy in the layout other tools read
            interop_config = write_compressed_tensors(model, tmp, compressed, dtype=dtype)
        else:
            state = dense_state(model, compressed, dense_copy)
            model.save_pretrained(tmp, safe_serialization=True, state_dict=cast_state(state, dtype))
            update_config_json(tmp, dtype=export.dtype_name)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if "gguf" in exports:
            extra["gguf"] = gguf_export.write_gguf(
                model, tmp / gguf_export.GGUF_FILE, compressed, tokenizer, dtype, output.path.name
            )
        export.add_layers(compressed)
        export.add_transforms(installed(model))
        interop_entry = {"layout": interop, "quantization_config": interop_config}
        export.finish(report, extra, interop_entry if interop else None, stats)
    logger.info("saved compressed model to %s", output.path)
    return output.path


def interop_layout(compressed: dict[str, CompressedLinear], dense_copy: bool) -> str | None:
    """The other tools' layout the dense copy is written in: the one every compressed layer
    names (``"compressed-tensors"`` for int8), else ``None`` (plain dense weights)."""
    layouts = {module.interop for module in compressed.values()}
    interop = layouts.pop() if len(layouts) == 1 and dense_copy else None
    if interop == "compressed-tensors" and any(m.conv1d for m in compressed.values()):
        logger.warning(
            "GPT-2's Conv1D layers have no compressed-tensors form: the dense copy holds "
            "the dequantized weights instead"
        )
        return None
    if interop == "compressed-tensors" and (
        why := compressed_tensors_refusal(compressed, loadable=True)
    ):
        logger.warning(
            "no compressed-tensors form (%s): the dense copy holds the dequantized weights instead",
            why,
        )
        return None
    return interop


def compressed_modules(
    model: nn.Module, layers: Iterable[LayerReport], root: nn.Module | None = None, prefix: str = ""
) -> dict[str, CompressedLinear]:
    """``{name: compressed module}`` of every layer to store in a compressed format: the
    :class:`CompressedLinear` modules in ``root`` (default: the whole model; a block named
    ``prefix``), that is where a method replaced the layer, and the ``layers`` whose report
    names a format, encoded with that format's ``from_linear``."""
    root = model if root is None else root
    found = {
        prefix + name: module
        for name, module in root.named_modules()
        if isinstance(module, CompressedLinear)
    }
    for layer in layers:
        if layer.format is None or layer.name in found:
            continue
        module = model.get_submodule(layer.name)
        found[layer.name] = format_class(layer.format).from_linear(module, **layer.format_options)
    return found


def dense_state(
    model: nn.Module,
    compressed: dict[str, CompressedLinear],
    dense_copy: bool,
    root: nn.Module | None = None,
    prefix: str = "",
) -> dict[str, torch.Tensor]:
    """The state dict of ``root`` (default: the model; a block named ``prefix``) to store as
    weights: each compressed layer as its ``to_dense()`` (``dense_copy``: compressed modules
    standing in the model are swapped for their dense layers while the state is taken, and
    swapped back even on error), or left out."""
    root = model if root is None else root
    in_model = {n: m for n, m in compressed.items() if model.get_submodule(n) is m}
    swapped = {}
    skip: tuple[str, ...] = () if dense_copy else tuple(f"{name}." for name in compressed)
    try:
        if dense_copy:
            swapped = replace_modules(model, in_model, lambda _, module: module.to_dense())
        return {
            prefix + k: v for k, v in root.state_dict().items() if not (prefix + k).startswith(skip)
        }
    finally:
        replace_modules(model, swapped, lambda name, _: in_model[name])


class Export:
    """The parts of an output directory (``tmp``, renamed into place by the caller) that every
    export writes the same way: the compressed layers and transforms packed into
    ``compressed.safetensors``, ``compression.json``, the model card and ``report.png``, the
    entry through which ``from_pretrained`` loads a compact export, and the stats.

    A streamed export writes each block's layers to a part (:meth:`flush`) as it goes; the
    parts are concatenated at the end without loading them."""

    def __init__(self, tmp: Path, title: str, dtype: torch.dtype, dense_copy: bool) -> None:
        """``title``: the output directory's name, the model card's heading."""
        self.tmp, self.title, self.dtype, self.dense_copy = tmp, title, dtype, dense_copy
        self.layouts: dict[str, dict[str, Any]] = {}
        self.transforms: list[dict[str, Any]] = []
        self.keys: list[str] = []  # every key of compressed.safetensors
        self.pending: dict[str, torch.Tensor] = {}
        self.parts: list[Path] = []

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def add_layers(self, compressed: dict[str, CompressedLinear]) -> None:
        """Pack each layer in its format's tensors (floating ones in the save dtype, except a
        format's ``exact_tensors``) and record how to rebuild it."""
        for name, module in compressed.items():
            stored = {
                key: t.detach().cpu().contiguous()
                if key in module.exact_tensors
                else cast_tensor(t, self.dtype)
                for key, t in module.state_tensors().items()
            }
            self._add({f"{name}.{key}": t for key, t in stored.items()})
            self.layouts[name] = {
                "format": module.format,
                "meta": module.meta(),
                "tensors": sorted(stored),
            }

    def add_transforms(self, transforms: list[ModelTransform]) -> None:
        for index, transform in enumerate(transforms):
            stored = {
                k: t.detach().cpu().contiguous() for k, t in transform.state_tensors().items()
            }
            self._add({f"{TRANSFORMS_PREFIX}{index}.{key}": t for key, t in stored.items()})
            self.transforms.append(
                {"kind": transform.kind, "meta": transform.meta(), "tensors": sorted(stored)}
            )

    def _add(self, tensors: dict[str, torch.Tensor]) -> None:
        self.pending.update(tensors)
        self.keys += list(tensors)

    def flush(self, name: str) -> None:
        """Write the tensors packed so far to a part of ``compressed.safetensors``."""
        if self.pending:
            self.parts.append(self.tmp / PARTS / f"{name}.safetensors")
            self.parts[-1].parent.mkdir(exist_ok=True)
            save_file(self.pending, str(self.parts[-1]))
        self.pending = {}

    def finish(
        self,
        report: CompressionReport,
        results: dict[str, Any],
        interop: dict[str, Any] | None = None,
        stats: Any = None,
    ) -> dict[str, Any]:
        """Write ``compressed.safetensors``, the loading entry of a compact export, the
        manifest, the model card, ``report.png`` and the stats; return the manifest."""
        metadata = {"format_version": str(FORMAT_VERSION)}
        if self.parts:
            self.flush("last")
            merge_safetensors(self.parts, self.tmp / COMPRESSED_TENSORS, metadata=metadata)
            shutil.rmtree(self.tmp / PARTS)
        elif self.pending:
            save_file(self.pending, str(self.tmp / COMPRESSED_TENSORS), metadata=metadata)
        self.pending = {}
        if not self.dense_copy and self.keys:  # from_pretrained builds the runtime
            write_loading_entry(self.tmp, self.layouts, self.transforms, sorted(self.keys))
        manifest = {
            "format_version": FORMAT_VERSION,
            "method": report.method,
            "config": report.config,
            "dtype": self.dtype_name,
            "dense_copy": self.dense_copy,
            "interop": interop,
            "versions": versions(),
            "compressed_layers": self.layouts,
            "transforms": self.transforms,
            "results": results,
            "report": report.to_dict(),
        }
        (self.tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        # for a person: the card and the plots, from the manifest alone
        (self.tmp / MODEL_CARD).write_text(model_card(manifest, self.title), encoding="utf-8")
        write_report_png(manifest, self.tmp / REPORT_PNG)
        if stats is not None and stats.tensors:
            stats.save(self.tmp / STATS)
        return manifest


def write_loading_entry(
    out_dir: Path,
    layers: dict[str, dict[str, Any]],
    transforms: list[dict[str, Any]],
    compressed_keys: list[str],
) -> None:
    """Make a compact export (``out_dir`` already holding ``config.json``, ``model.safetensors``
    or its shards, and ``compressed.safetensors`` with ``compressed_keys``) loadable by
    ``from_pretrained``: write :data:`WEIGHTS_INDEX` and point ``config.json`` at it, with the
    ``quantization_config`` that selects lmcompress's quantizer
    (:mod:`~lmcompress.compressor.io.hf_quantizer`)."""
    weight_map = {
        key: path.name for key, (path, _) in TensorFiles.of_checkpoint(out_dir).files.items()
    }
    weight_map.update(dict.fromkeys(compressed_keys, COMPRESSED_TENSORS))
    index = {
        "metadata": {},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (out_dir / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    quantization_config = {
        "quant_method": QUANT_METHOD,
        "format_version": FORMAT_VERSION,
        "compressed_layers": layers,
        "transforms": transforms,
    }
    update_config_json(
        out_dir, quantization_config=quantization_config, transformers_weights=WEIGHTS_INDEX
    )
