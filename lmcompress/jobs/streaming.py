"""Compress a model larger than memory: one decoder block in memory at a time (``--streaming``).

The model is a skeleton on the meta device (module names, shapes, no memory). The layer-wise
loop (:func:`~lmcompress.compressor.calibration.layerwise.compress_layerwise`) asks a
:class:`Streamer` for
weights: the embeddings are read from the checkpoint's safetensors shards (each tensor read straight
into its destination: :func:`~lmcompress.compressor.io.shards.read_unmapped`) for the capture and
freed
once the first block's inputs are recorded; each block is read just before it is calibrated, and
once compressed it is written to its own output shard and returned to the meta device. The head is
never materialised (calibration stops before it, and evaluation is left to ``compress-model eval``
on a machine that holds the model): its tensor is copied from the checkpoint into the output. Peak
memory is one block, its statistics and the calibration activations (which ``--offload-activations
DIR`` moves to disk), whatever the depth.

The output is the directory :func:`~lmcompress.compressor.io.save.save_compressed` writes, with
the dense copy sharded (``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``,
one shard per block, which transformers and :func:`load_compressed` read) and the compressed
tensors concatenated from per-block parts into one ``compressed.safetensors`` without loading
them. Every operation on the numbers is the in-memory path's, in the same order and dtype, so
the tensors written are bit-identical to it (``tests/compressor/test_streaming.py``;
``benchmarks/streaming.py`` on a 2 GB model).

Methods that say ``streams = True`` support it: magnitude, Wanda and SparseGPT (each layer
needs only its own block's inputs). The others see the whole model at once (learned masks,
low-rank with Fisher factors, int8 calibration) and refuse it with one line.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file
from torch import nn

from lmcompress.compressor.formats.base import CompressedLinear
from lmcompress.compressor.formats.catalog import format_class
from lmcompress.compressor.io.layout import (
    COMPRESSED_TENSORS,
    DENSE_TENSORS,
    FORMAT_VERSION,
    MANIFEST,
)
from lmcompress.compressor.io.load import key_renaming
from lmcompress.compressor.io.shards import TensorFiles, cast_tensor, merge_safetensors
from lmcompress.compressor.model.families import family_of
from lmcompress.compressor.model.surgery import replace_modules
from lmcompress.compressor.report import CompressionReport, LayerReport
from lmcompress.compressor.util.fsutil import atomic_dir
from lmcompress.errors import ConfigError, ModelLoadError

if TYPE_CHECKING:
    from lmcompress.compressor.method import Method
    from lmcompress.jobs.run import RunOptions

logger = logging.getLogger(__name__)

SHARD = "model-{index:05d}-of-{total:05d}.safetensors"
_PARTS = ".compressed-parts"  # per-block compressed tensors, merged at the end


def check_streaming(options: RunOptions, method: Method) -> Path:
    """The local checkpoint directory a streamed job reads; a one-line :class:`ConfigError`
    for what streaming cannot do."""
    if not getattr(method, "streams", False):
        from lmcompress.methods import METHODS

        able = ", ".join(name for name, cls in METHODS.items() if getattr(cls, "streams", False))
        raise ConfigError(
            f"--streaming supports the block-by-block methods ({able}), not {method.name!r}, "
            "which needs the whole model at once"
        )
    if options.output is None:
        raise ConfigError("--streaming writes the model block by block: give an output (-o OUT)")
    if options.lm_eval_tasks:
        raise ConfigError("--streaming does not evaluate: drop --lm-eval-tasks")
    path = Path(options.checkpoint).expanduser()
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"--streaming reads a local checkpoint directory of safetensors shards; "
            f"{options.checkpoint} is not one"
        )
    return path


def streaming_weight_bytes(skeleton: nn.Module, itemsize: int) -> int:
    """Peak bytes of weights a streamed job holds: the largest block (read, plus its pages of
    the memory-mapped shard while it is read), or the embeddings during the capture."""
    blocks = skeleton.get_submodule(family_of(skeleton).blocks)
    block = max(sum(p.numel() for p in b.parameters()) for b in blocks)
    inside = {id(p) for p in blocks.parameters()}
    head = skeleton.get_submodule(family_of(skeleton).head).weight
    rest = sum(p.numel() for p in skeleton.parameters() if id(p) not in inside and p is not head)
    return max(2 * block, rest + head.numel()) * itemsize


class Streamer:
    """A :class:`~lmcompress.compressor.calibration.layerwise.BlockSource` reading a checkpoint
    directory
    and writing an output directory ``out`` (a temporary one, renamed by the caller).

    Args:
        model: the skeleton (parameters on meta, buffers real).
        checkpoint: directory with ``model.safetensors`` or shards and their index.
        dtype: compute dtype (checkpoint tensors are cast to it, as ``from_pretrained`` does).
        save_dtype: dtype of the written floating-point tensors.
        dense_copy: write the compressed layers' dense weights too (as ``save_compressed``).
    """

    def __init__(
        self,
        model: nn.Module,
        checkpoint: Path,
        out: Path,
        dtype: torch.dtype,
        save_dtype: torch.dtype,
        dense_copy: bool = True,
    ) -> None:
        self.model, self.out, self.dtype, self.save_dtype = model, out, dtype, save_dtype
        self.dense_copy = dense_copy
        model.tie_weights()  # a skeleton from the config is not tied yet
        self.source = TensorFiles.of_checkpoint(checkpoint, "cpu", key_renaming(model))
        family = family_of(model)
        self.prefix = family.blocks + "."
        self.blocks = model.get_submodule(family.blocks)
        # tied weights: each storage read and written once, under its first name
        self.keys = set(_owned_keys(model).values())
        missing = sorted(k for k in self.keys if k not in self.source.files)
        if missing:
            raise ModelLoadError(
                f"{checkpoint}: {len(missing)} weights missing from the checkpoint, "
                f"e.g. {missing[0]}"
            )
        head = family.head + "."
        self.embedding_keys = sorted(k for k in self.keys if not k.startswith((self.prefix, head)))
        self.head_keys = sorted(k for k in self.keys if k.startswith(head))
        self.total = len(self.blocks) + 2  # embeddings and the rest, a shard per block, head
        self.weight_map: dict[str, str] = {}
        self.total_size = 0
        self.layouts: dict[str, dict[str, Any]] = {}
        self.parts: list[Path] = []
        self.embeddings_written = False
        (out / _PARTS).mkdir(parents=True)

    # BlockSource
    def load_embeddings(self, model: nn.Module) -> None:
        self._materialise(model, "", self.embedding_keys)

    def free_embeddings(self, model: nn.Module) -> None:
        self._write_shard(1, {k: self._owner(k) for k in self.embedding_keys})
        for key in self.embedding_keys:
            _to_meta(model, key)
        self.embeddings_written = True

    def load(self, index: int, block: nn.Module) -> None:
        self._materialise(block, f"{self.prefix}{index}.", self._block_keys(index))

    def release(self, index: int, block: nn.Module, reports: list[LayerReport]) -> None:
        """Write block ``index``'s dense shard and compressed part, then free it."""
        prefix = f"{self.prefix}{index}."
        compressed = self._compressed(block, prefix, reports)
        tensors: dict[str, torch.Tensor] = {}
        for name, module in compressed.items():
            stored = {
                key: t.detach().cpu().contiguous()
                if key in module.exact_tensors
                else cast_tensor(t, self.save_dtype)
                for key, t in module.state_tensors().items()
            }
            tensors.update({f"{name}.{key}": t for key, t in stored.items()})
            self.layouts[name] = {
                "format": module.format,
                "meta": module.meta(),
                "tensors": sorted(stored),
            }
        if tensors:
            self.parts.append(self.out / _PARTS / f"block-{index:05d}.safetensors")
            save_file(tensors, str(self.parts[-1]))
        del tensors
        swapped = {}
        in_block = {
            n: m for n, m in compressed.items() if self.model.get_submodule(n) is m
        }  # methods that replaced the layer: the dense copy holds its to_dense()
        try:
            if self.dense_copy:
                swapped = replace_modules(self.model, in_block, lambda _, m: m.to_dense())
                skip: tuple[str, ...] = ()
            else:
                skip = tuple(f"{name}." for name in compressed)
            state = {
                prefix + k: v
                for k, v in block.state_dict().items()
                if prefix + k in self.keys and not (prefix + k).startswith(skip)
            }
            self._write_shard(index + 2, state)
        finally:
            replace_modules(self.model, swapped, lambda name, _: in_block[name])
        del state
        block.to_empty(device="meta")

    # the end
    def finish(self, report: CompressionReport) -> dict[str, Any]:
        """Copy the head, write the index and ``compressed.safetensors``; the manifest's
        ``compressed_layers``."""
        if not self.embeddings_written:  # a method without calibration never captured
            self._copy_shard(1, self.embedding_keys)
        self._copy_shard(self.total, self.head_keys)
        index = {"metadata": {"total_size": self.total_size}, "weight_map": self.weight_map}
        (self.out / f"{DENSE_TENSORS}.index.json").write_text(json.dumps(index, indent=2) + "\n")
        if self.parts:
            merge_safetensors(
                self.parts,
                self.out / COMPRESSED_TENSORS,
                metadata={"format_version": str(FORMAT_VERSION)},
            )
        shutil.rmtree(self.out / _PARTS)
        unwritten = [
            layer.name for layer in report.layers if layer.format and layer.name not in self.layouts
        ]
        if unwritten:  # a method whose streamed pass skipped a block's release
            raise RuntimeError(f"compressed layers never written: {unwritten[:3]}")
        return self.layouts

    def _copy_shard(self, index: int, keys: list[str]) -> None:
        """Checkpoint to output without the model: cast to the compute dtype (as the model
        would hold them), then to the save dtype."""
        tensors = self._read(keys)
        self._write_shard(
            index, {k: t.to(self.dtype) if t.is_floating_point() else t for k, t in tensors.items()}
        )

    def _read(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """``keys`` (model names) from the checkpoint, each shard opened once, unmapped."""
        return self.source.read(keys, mmap=False)

    def _block_keys(self, index: int) -> list[str]:
        prefix = f"{self.prefix}{index}."
        return sorted(k for k in self.keys if k.startswith(prefix))

    def _owner(self, key: str) -> torch.Tensor:
        module, _, name = key.rpartition(".")
        return getattr(self.model.get_submodule(module), name)

    def _materialise(self, module: nn.Module, prefix: str, keys: list[str]) -> None:
        """Read ``keys`` (full names) into ``module`` (named from ``prefix``), cast to the
        compute dtype, replacing the meta tensors (``assign``: no second copy)."""
        tensors = self._read(keys)
        state = {
            key.removeprefix(prefix): t.to(self.dtype) if t.is_floating_point() else t
            for key, t in tensors.items()
        }
        del tensors
        module.load_state_dict(state, strict=False, assign=True)

    def _compressed(
        self, block: nn.Module, prefix: str, reports: list[LayerReport]
    ) -> dict[str, CompressedLinear]:
        """As :func:`~lmcompress.compressor.io.save.compressed_modules`, for one block."""
        found = {
            prefix + name: module
            for name, module in block.named_modules()
            if isinstance(module, CompressedLinear)
        }
        for layer in reports:
            if layer.format is not None and layer.name not in found:
                module = self.model.get_submodule(layer.name)
                found[layer.name] = format_class(layer.format).from_linear(
                    module, **layer.format_options
                )
        return found

    def _write_shard(self, index: int, state: dict[str, torch.Tensor]) -> None:
        name = SHARD.format(index=index, total=self.total)
        tensors = {k: cast_tensor(v, self.save_dtype) for k, v in state.items()}
        save_file(tensors, str(self.out / name), metadata={"format": "pt"})
        self.weight_map.update(dict.fromkeys(tensors, name))
        self.total_size += sum(t.nbytes for t in tensors.values())


def _owned_keys(model: nn.Module) -> dict[int, str]:
    """``{id(tensor): first state-dict name}``: tied tensors are read and written once."""
    owned: dict[int, str] = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        owned.setdefault(id(tensor), key)
    return owned


def _to_meta(model: nn.Module, key: str) -> None:
    module_name, _, name = key.rpartition(".")
    module = model.get_submodule(module_name)
    tensor = getattr(module, name)
    meta = torch.empty_like(tensor, device="meta")
    if name in module._parameters:
        module._parameters[name] = nn.Parameter(meta, requires_grad=tensor.requires_grad)
    else:
        module._buffers[name] = meta


def run_streaming(options: RunOptions, method: Method) -> dict[str, Any]:
    """:func:`lmcompress.jobs.run.run` with the model never whole in memory: checks, tokenizer
    and calibration windows, the skeleton, the method's streamed pass, and the output directory
    written block by block (atomically: renamed into place at the end). No evaluation."""
    from lmcompress.compressor.io.layout import MODEL_CARD, REPORT_PNG
    from lmcompress.compressor.io.model_card import model_card
    from lmcompress.compressor.io.report_plot import write_report_png
    from lmcompress.compressor.io.save import versions as _versions
    from lmcompress.compressor.model.checkpoint import model_config
    from lmcompress.compressor.model.loading import load_tokenizer as _load_tokenizer
    from lmcompress.compressor.model.loading import model_skeleton, resolve_dtype
    from lmcompress.compressor.options import command_line
    from lmcompress.compressor.util.memory import set_mmap_threshold
    from lmcompress.evaluation.corpora import calibration_windows, tokenize
    from lmcompress.jobs.preflight import preflight

    checkpoint = check_streaming(options, method)
    preflight(options, method)
    start = time.perf_counter()
    if options.eval:
        logger.info(
            "--streaming does not evaluate (%s skipped): score the output with "
            "`compress-model eval %s` where it fits in memory",
            ", ".join(options.eval),
            options.output,
        )
    set_mmap_threshold(2**20)  # freed blocks go back to the system, not to a fragmented heap
    dtype = resolve_dtype(options.dtype)
    save_dtype = dtype if options.save_dtype == "auto" else resolve_dtype(options.save_dtype)
    tokenizer = _load_tokenizer(str(checkpoint), False, {"trust_remote_code": False})
    calib = None
    if method.needs_calibration:
        if tokenizer is None:
            raise ModelLoadError(f"{options.checkpoint} has no tokenizer: cannot read text")
        ids = tokenize(tokenizer, options.calib)
        calib = calibration_windows(ids, options.nsamples, options.seq_len, options.seed)
    config = model_config(checkpoint, options.trust_remote_code)
    model = model_skeleton(config, dtype, options.trust_remote_code, real_buffers=True)
    out = Path(options.output)
    results: dict[str, Any] = {
        "options": asdict(options),
        "checkpoint": options.checkpoint,
        "command": command_line(
            "compress-model", options.checkpoint, method.name, options, method.config
        ),
    }
    offload = contextlib.nullcontext()
    if options.offload_activations:
        Path(options.offload_activations).mkdir(parents=True, exist_ok=True)
        offload = tempfile.TemporaryDirectory(
            prefix="lmcompress-activations-", dir=options.offload_activations
        )
    with atomic_dir(out) as tmp:
        streamer = Streamer(model, checkpoint, tmp, dtype, save_dtype, options.dense_copy)
        with offload as offload_dir:
            report = method.compress_streaming(model, calib, streamer, offload_dir=offload_dir)
        layouts = streamer.finish(report)
        model.config.architectures = [type(model).__name__]  # as save_pretrained records it
        model.config.save_pretrained(tmp)
        config_file = tmp / "config.json"  # the stored dtype, as save_compressed writes it
        config_dict = json.loads(config_file.read_text())
        config_dict["dtype"] = str(save_dtype).removeprefix("torch.")
        config_file.write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")
        if model.can_generate():
            model.generation_config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if not options.dense_copy and layouts:
            from lmcompress.compressor.io.save import write_loading_entry

            keys = [f"{n}.{k}" for n, entry in layouts.items() for k in entry["tensors"]]
            write_loading_entry(tmp, layouts, [], sorted(keys))
        results.update(compressed={}, summary=report.summary())  # no corpus scored
        results["seconds"] = time.perf_counter() - start
        results["output"] = options.output
        manifest = {
            "format_version": FORMAT_VERSION,
            "method": report.method,
            "config": report.config,
            "dtype": str(save_dtype).removeprefix("torch."),
            "dense_copy": options.dense_copy,
            "interop": None,
            "versions": _versions(),
            "compressed_layers": layouts,
            "transforms": [],
            "results": results,
            "report": report.to_dict(),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        (tmp / MODEL_CARD).write_text(model_card(manifest, out.resolve().name), encoding="utf-8")
        write_report_png(manifest, tmp / REPORT_PNG)
    logger.info("saved compressed model to %s", out)
    results["report"] = report
    return results
