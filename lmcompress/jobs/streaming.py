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

Streaming is a target of the one job skeleton (:mod:`lmcompress.jobs.run`), not a runner of its
own: :class:`StreamedModel` hands the job a skeleton, and its block source (:class:`Streamer`)
to the method. The output is the directory :func:`~lmcompress.compressor.io.save.save_compressed`
writes, through the same :class:`~lmcompress.compressor.io.save.Export`, with the dense copy
sharded (``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``,
one shard per block, which transformers and :func:`load_compressed` read) and the compressed
tensors concatenated from per-block parts into one ``compressed.safetensors`` without loading
them. Every operation on the numbers is the in-memory path's, in the same order and dtype, so
the tensors written are bit-identical to it (``tests/jobs/test_streaming.py``;
``benchmarks/streaming.py`` on a 2 GB model).

Methods that say ``streams = True`` support it: magnitude, Wanda and SparseGPT (each layer
needs only its own block's inputs). The others see the whole model at once (learned masks,
low-rank with Fisher factors, int8 calibration) and refuse it with one line.
"""

from __future__ import annotations

import contextlib
import json
import logging
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from lmcompress.compressor.io import compressed_tensors
from lmcompress.compressor.io.layout import DENSE_TENSORS, update_config_json
from lmcompress.compressor.io.load import key_renaming
from lmcompress.compressor.io.output import OutputDir
from lmcompress.compressor.io.save import Export, compressed_modules, dense_state, interop_layout
from lmcompress.compressor.io.shards import TensorFiles, cast_tensor
from lmcompress.compressor.method import Method, Stats
from lmcompress.compressor.model.families import family_of
from lmcompress.compressor.model.loading import load_tokenizer, resolve_dtype
from lmcompress.compressor.report import CompressionReport, LayerReport
from lmcompress.compressor.util.fsutil import made_dirs
from lmcompress.compressor.util.memory import release_free_memory, set_mmap_threshold
from lmcompress.errors import ConfigError, LmcompressError, ModelLoadError, cut
from lmcompress.evaluation.generated import SELF_CORPUS
from lmcompress.jobs.options import RunOptions
from lmcompress.methods import METHODS

logger = logging.getLogger(__name__)

SHARD = "model-{index:05d}-of-{total:05d}.safetensors"


def check_streaming(options: RunOptions, method: Method) -> Path:
    """The local checkpoint directory a streamed job reads; a one-line :class:`ConfigError`
    for what streaming cannot do."""
    if not method.streams:
        able = ", ".join(name for name, cls in METHODS.items() if cls.streams)
        raise ConfigError(
            f"--streaming supports the block-by-block methods ({able}), not {method.name!r}, "
            "which needs the whole model at once"
        )
    if getattr(method.config, "head", "float") != "float":
        raise ConfigError(
            "--streaming never holds the output head (it is copied from the checkpoint): "
            "drop --head"
        )
    if getattr(method.config, "distill_steps", 0):
        raise ConfigError(
            "--streaming never holds the whole model, which --distill-steps trains end to end: "
            "drop one of them"
        )
    if options.output is None:
        raise ConfigError("--streaming writes the model block by block: give an output (-o OUT)")
    if options.lm_eval_tasks:
        raise ConfigError("--streaming does not evaluate: drop --lm-eval-tasks")
    if options.calib == SELF_CORPUS:
        raise ConfigError(
            "--calib self samples text from the whole model, which --streaming never holds: "
            "give a corpus or a file"
        )
    if options.eval:  # the command line leaves the default corpus out (jobs.recipe.job_from)
        raise ConfigError(
            f"--streaming does not evaluate: drop --eval {cut(' '.join(options.eval))} (in Python, "
            "eval=()) and score the output with `compress-model eval OUT` where it fits"
        )
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
    directory and writing an output directory through ``export`` (the
    :class:`~lmcompress.compressor.io.save.Export` of a temporary directory, renamed by the
    caller): each block's dense shard and its compressed layers.

    Args:
        model: the skeleton (parameters on meta, buffers real).
        checkpoint: directory with ``model.safetensors`` or shards and their index.
        export: where the output goes, in its save dtype, with or without the dense copy.
        dtype: compute dtype (checkpoint tensors are cast to it, as ``from_pretrained`` does).
    """

    def __init__(self, model: nn.Module, checkpoint: Path, export: Export, dtype: torch.dtype):
        self.model, self.export, self.out, self.dtype = model, export, export.tmp, dtype
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
        self.embeddings_written = False
        # the dense copy's layout, from the first block with compressed layers (all share the
        # method's options), and the compressed-tensors scheme of each layer written in it
        self.interop: str | None = None
        self.schemes: dict[str, dict[str, Any]] = {}
        self.packed: set[bool] = set()

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
        """Write block ``index``'s compressed layers and dense shard, then free it."""
        prefix = f"{self.prefix}{index}."
        compressed = compressed_modules(self.model, reports, root=block, prefix=prefix)
        self.export.add_layers(compressed)
        self.export.flush(f"block-{index:05d}")
        if compressed and self.interop is None:  # the first block with compressed layers
            self.interop = interop_layout(compressed, self.export.dense_copy) or ""
        elif self.interop == "compressed-tensors" and (
            why := compressed_tensors.refusal(compressed, loadable=True)
        ):
            raise LmcompressError(f"block {index} has no compressed-tensors form: {why}")
        if self.interop == "compressed-tensors" and compressed:  # as write_compressed_tensors
            state = dense_state(self.model, compressed, False, block, prefix)
            shard = {k: v for k, v in state.items() if k in self.keys}
            exact = {}
            for name, module in compressed.items():
                self.schemes[name] = compressed_tensors.layer_scheme(name, module)
                self.packed.add(compressed_tensors.is_packed(module))
                exact.update(compressed_tensors.stored_tensors(name, module, self.export.dtype))
            self._write_shard(index + 2, shard, exact)
        else:
            state = dense_state(self.model, compressed, self.export.dense_copy, block, prefix)
            self._write_shard(index + 2, {k: v for k, v in state.items() if k in self.keys})
        del state
        block.to_empty(device="meta")
        # The block's smaller tensors (below the 1 MiB mmap threshold) were freed into glibc's
        # heaps, which keep them: without this, RSS after each block grew ~15 MiB a block
        # (8 blocks of 29 MB: peak 680 MiB against 578 for 2; with it 600-615; see
        # tests/jobs/test_streaming.py)
        release_free_memory()

    # the end
    def finish(self, report: CompressionReport) -> None:
        """Copy the head (and the embeddings of a method that never captured), write the
        dense shards' index; check every compressed layer was written."""
        if not self.embeddings_written:  # a method without calibration never captured
            self._copy_shard(1, self.embedding_keys)
        self._copy_shard(self.total, self.head_keys)
        index = {"metadata": {"total_size": self.total_size}, "weight_map": self.weight_map}
        (self.out / f"{DENSE_TENSORS}.index.json").write_text(json.dumps(index, indent=2) + "\n")
        layouts = self.export.layouts
        unwritten = [
            layer.name for layer in report.layers if layer.format and layer.name not in layouts
        ]
        if unwritten:  # a method whose streamed pass skipped a block's release
            raise RuntimeError(f"compressed layers never written: {unwritten[:3]}")

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

    def quantization_config(self) -> dict[str, Any] | None:
        """``config.json``'s ``quantization_config`` of the layers written in the
        compressed-tensors layout (``None``: the dense copy holds plain weights)."""
        if not self.schemes:
            return None
        linears = compressed_tensors.linear_names(self.model)
        return compressed_tensors.config_of_schemes(self.schemes, self.packed, linears)

    def _write_shard(
        self,
        index: int,
        state: dict[str, torch.Tensor],
        exact: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """``state`` cast to the save dtype, and ``exact`` tensors as they are."""
        name = SHARD.format(index=index, total=self.total)
        tensors = {k: cast_tensor(v, self.export.dtype) for k, v in state.items()}
        tensors.update(exact or {})
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


class StreamedModel:
    """The target of a ``--streaming`` job: a skeleton on the meta device whose blocks
    :class:`Streamer` reads from the checkpoint and writes to the output, block by block, inside
    a temporary directory renamed into place at the end. It has a tokenizer (for calibration)
    but is never evaluated: score the output with ``compress-model eval`` where it fits."""

    evaluates = False

    def __init__(
        self, options: RunOptions, skeleton: nn.Module, output: OutputDir | None = None
    ) -> None:
        """``skeleton``: the model of the checkpoint's config, parameters on the meta device,
        buffers real (the one preflight checked the method on); ``output``: the job's output
        directory (default: ``options.output``'s)."""
        self.options, self.model = options, skeleton
        self.output = output or OutputDir(options.output, options.overwrite)
        self.stack = contextlib.ExitStack()

    def __enter__(self) -> StreamedModel:
        options = self.options
        checkpoint = Path(options.checkpoint).expanduser()
        set_mmap_threshold(2**20)  # freed blocks go back to the system, not to a fragmented heap
        dtype = resolve_dtype(options.dtype)
        save_dtype = dtype if options.save_dtype == "auto" else resolve_dtype(options.save_dtype)
        self.tokenizer = load_tokenizer(str(checkpoint), False, {"trust_remote_code": False})
        out = self.output.path
        with self.stack:
            self.tmp = self.stack.enter_context(self.output.build())
            self.export_ = Export(self.tmp, out.resolve().name, save_dtype, options.dense_copy)
            self.streamer = Streamer(self.model, checkpoint, self.export_, dtype)
            self.stack = self.stack.pop_all()  # the directory stays open until __exit__
        return self

    def __exit__(self, *exc: Any) -> bool | None:
        return self.stack.__exit__(*exc)

    def compress(
        self, method: Method, data: torch.Tensor | None
    ) -> tuple[CompressionReport, Stats]:
        with contextlib.ExitStack() as stack:
            offload_dir = None
            if self.options.offload_activations:  # removed afterwards, with what it created
                stack.enter_context(made_dirs(self.options.offload_activations))
                offload_dir = stack.enter_context(
                    tempfile.TemporaryDirectory(
                        prefix="lmcompress-activations-", dir=self.options.offload_activations
                    )
                )
            return method.compress(self.model, data, source=self.streamer, offload_dir=offload_dir)

    def export(
        self, report: CompressionReport, results: dict[str, Any], stats: Stats | None
    ) -> None:
        """The rest of the output: the head and the index, the config, the tokenizer, and
        what every export writes (:meth:`Export.finish`)."""
        self.streamer.finish(report)
        model, tmp = self.model, self.tmp
        model.config.architectures = [type(model).__name__]  # as save_pretrained records it
        model.config.save_pretrained(tmp)
        interop_config = self.streamer.quantization_config()
        update_config_json(tmp, dtype=self.export_.dtype_name)  # the stored dtype
        if interop_config is not None:
            update_config_json(tmp, quantization_config=interop_config)
        if model.can_generate():
            model.generation_config.save_pretrained(tmp)
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(tmp)
        results["output"] = self.options.output
        interop = None
        if interop_config is not None:
            interop = {"layout": "compressed-tensors", "quantization_config": interop_config}
        self.export_.finish(report, results, interop, stats=stats)
        logger.info("saved compressed model to %s", self.options.output)
