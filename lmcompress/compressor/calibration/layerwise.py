"""Layer-wise calibration: compress a model one decoder block at a time.

Peak memory is one block plus the calibration activations, not the model (the SparseGPT /
Wanda "catcher" pattern, done once for every family):

1. **Capture.** Every decoder block is swapped for a recorder that stores the block's inputs
   (the hidden states entering block 0, and the keyword arguments each block receives: attention
   mask, position ids, rotary embeddings, ...) and passes the hidden states through; the last
   one stops the forward pass, so the head never runs. Keyword arguments do not depend on the
   hidden states, so recording them for every block is exact (Gemma3 gives sliding and global
   layers different masks and rotary tables).
2. **Per block.** The block moves to the compute device; forward pre-hooks on its selected
   layers feed each layer's inputs to that layer's statistics accumulator while the block runs
   over every calibration batch; the method then compresses the layers (in place); a second pass
   over the batches produces the *compressed* block's outputs, which become the next block's
   inputs (as SparseGPT and Wanda do). The block moves back to where it was.

With a :class:`BlockSource` the model need never be whole in memory (``--streaming``,
:mod:`lmcompress.jobs.streaming`): the skeleton sits on the meta device, the source
materialises what the capture runs (embeddings) and frees it once the inputs are recorded, then
materialises each block just before it is calibrated and writes and frees it just after.
With ``offload_dir`` the hidden states between blocks live on disk, one file per batch, read
back memory-mapped one batch at a time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from tqdm.auto import tqdm

from lmcompress.compressor.calibration.observers import SharedInputFeed
from lmcompress.compressor.model.families import family_of
from lmcompress.compressor.report import LayerReport
from lmcompress.compressor.util.fsutil import free_bytes, is_disk_full, no_space_error
from lmcompress.compressor.util.progress import bar_disabled

logger = logging.getLogger(__name__)


class Accumulator(Protocol):
    """Per-layer statistics fed with the layer's inputs, batch by batch."""

    def add_batch(self, inputs: torch.Tensor) -> None: ...  # (batch, tokens, in_features)


class BlockCompressor(Protocol):
    """Compresses one whole block: ``(index, block, layer names, accumulators, batches)`` ->
    reports. A batch is ``{"hidden": (B, T, H) block inputs, "args": [...], "kwargs": [...]}``
    (per-block positional/keyword arguments): run block ``index`` on it as
    ``block(b["hidden"], *b["args"][index], **b["kwargs"][index])``. Runs under no_grad."""

    def __call__(
        self,
        index: int,
        block: nn.Module,
        names: list[str],
        accumulators: dict[str, Accumulator],
        batches: list[dict[str, Any]],
    ) -> list[LayerReport]: ...


class BlockSource(Protocol):
    """Where a skeleton's weights come from, block by block, and where they go when done."""

    def load_embeddings(self, model: nn.Module) -> None:
        """Materialise what runs before the first block (embeddings, rotary tables)."""

    def free_embeddings(self, model: nn.Module) -> None:
        """The first block's inputs are recorded: what ran before it may go."""

    def load(self, index: int, block: nn.Module) -> None:
        """Materialise block ``index``."""

    def release(self, index: int, block: nn.Module, reports: list[LayerReport]) -> None:
        """Block ``index`` is compressed (``reports``) and its outputs computed: write, free."""


class _Activations:
    """Each batch's block inputs (B, T, H), in RAM (``directory=None``) or one file per batch
    on disk, read back memory-mapped (``torch.load(mmap=True)``) when that batch runs."""

    def __init__(self, batches: list[dict[str, Any]], directory: Path | None) -> None:
        self.batches, self.directory = batches, directory
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            for i, batch in enumerate(batches):
                self[i] = batch.pop("hidden")

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.directory is None:
            return self.batches[i]["hidden"]
        return torch.load(self._file(i), mmap=True, weights_only=True)

    def __setitem__(self, i: int, hidden: torch.Tensor) -> None:
        if self.directory is None:
            self.batches[i]["hidden"] = hidden
        else:  # a fresh file: the old one may still be mapped by a tensor in use
            path = self._file(i)
            tmp = path.with_suffix(".tmp")
            try:
                torch.save(hidden.detach().cpu().contiguous(), tmp)
            except (OSError, RuntimeError) as err:  # torch's writer hides ENOSPC's errno
                tmp.unlink(missing_ok=True)
                if is_disk_full(err) or free_bytes(tmp.parent) < hidden.nbytes:
                    raise no_space_error(self.directory, hidden.nbytes) from None
                raise
            tmp.replace(path)

    def _file(self, i: int) -> Path:
        return self.directory / f"hidden-{i:05d}.pt"

    def resident_bytes(self) -> int:
        if self.directory is None:
            return _nbytes([b["hidden"] for b in self.batches])
        return max((self[i].nbytes for i in range(min(len(self), 1))), default=0)


@dataclass
class LayerwiseStats:
    """What the loop measured about itself."""

    blocks: int = 0
    seconds: float = 0.0
    # Largest number of bytes the loop held at once: activations plus the current block's
    # accumulators (the block's own weights not included).
    peak_state_bytes: int = 0
    per_block_seconds: list[float] = field(default_factory=list)


class _StopForward(Exception):
    pass


class _Recorder(nn.Module):
    """Stands in for block ``index`` during capture."""

    def __init__(self, index: int, last: bool, store: list[dict[str, Any]]) -> None:
        super().__init__()
        self.index, self.last, self.store = index, last, store

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.index == 0:
            self.store.append({"hidden": hidden_states, "args": [], "kwargs": []})
        self.store[-1]["args"].append(args)
        self.store[-1]["kwargs"].append(kwargs)
        if self.last:
            raise _StopForward
        return hidden_states


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o) for o in obj)
    if isinstance(obj, dict):
        return sum(_nbytes(o) for o in obj.values())
    return sum(_nbytes(v) for v in vars(obj).values()) if hasattr(obj, "__dict__") else 0


def _to_device(module: nn.Module, device: torch.device) -> None:
    """``module.to(device)`` for its materialised tensors; meta ones (a streamed skeleton's
    blocks and head) stay on meta."""
    module._apply(lambda t: t if t.is_meta else t.to(device))


def _first(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output


@torch.no_grad()
def capture_block_inputs(
    model: nn.Module, data: torch.Tensor, batch_size: int, device: torch.device
) -> list[dict[str, Any]]:
    """Run the model up to its first block for every batch of ``data`` (nsamples, seq_len).

    Returns one entry per batch: ``hidden`` (B, T, hidden) and, per block, its ``args`` and
    ``kwargs``. Blocks stay where they are; everything else runs on ``device``.
    """
    blocks = model.get_submodule(family_of(model).blocks)
    originals = list(blocks)
    store: list[dict[str, Any]] = []
    for i in range(len(blocks)):
        blocks[i] = _Recorder(i, i == len(blocks) - 1, store)
    try:
        _to_device(model, device)  # embeddings, rotary tables, norms: the blocks are recorders
        for start in range(0, data.shape[0], batch_size):
            try:
                model(input_ids=data[start : start + batch_size].to(device), use_cache=False)
            except _StopForward:
                pass
    finally:
        for i, block in enumerate(originals):
            blocks[i] = block
    return store


@torch.no_grad()
def compress_layerwise(
    model: nn.Module,
    data: torch.Tensor,
    layers: dict[str, nn.Module],
    make_accumulator: Callable[[str, nn.Module], Accumulator],
    compress_layer: Callable[[str, nn.Module, Accumulator], LayerReport] | None = None,
    device: str | torch.device = "cpu",
    batch_size: int = 8,
    progress: bool = True,
    compress_block: BlockCompressor | None = None,
    source: BlockSource | None = None,
    offload_dir: str | Path | None = None,
) -> tuple[list[LayerReport], LayerwiseStats]:
    """Compress ``layers`` (selected linears, qualified names) block by block.

    ``make_accumulator(name, module)`` builds each layer's statistics; after the block has seen
    every batch, ``compress_layer(name, module, accumulator)`` compresses the layer in place and
    reports. With ``compress_block``, that call replaces the per-layer one and gets the whole
    block, its batches and every accumulator (block-wise training, e.g. MaskLLM's block mode):
    give exactly one of the two. Layers outside the decoder blocks are not supported here.

    ``source``: the model is a meta-device skeleton whose weights ``source`` materialises and
    frees block by block (:class:`BlockSource`). ``offload_dir``: keep the hidden states between
    blocks in files there instead of in RAM (with ``compress_layer`` only). Neither changes a
    single operation on the numbers: the results are bit-identical to the in-memory loop's.
    """
    if (compress_layer is None) == (compress_block is None):
        raise ValueError("give exactly one of compress_layer and compress_block")
    if offload_dir is not None and compress_block is not None:
        raise ValueError("offload_dir works with compress_layer only")
    start = time.perf_counter()
    device = torch.device(device)
    prefix, blocks = _decoder_blocks(model, layers)
    was_training = model.training
    home_device = next((p.device for p in model.parameters() if not p.is_meta), device)
    model.eval()
    if source is not None:
        source.load_embeddings(model)
    batches = capture_block_inputs(model, data, batch_size, device)
    if source is not None:
        source.free_embeddings(model)
    hidden = _Activations(batches, None if offload_dir is None else Path(offload_dir))
    stats = LayerwiseStats(blocks=len(blocks))
    reports: list[LayerReport] = []
    for index in tqdm(
        range(len(blocks)), desc="blocks", unit="block", disable=bar_disabled(progress)
    ):
        block_start = time.perf_counter()
        block = blocks[index]
        if source is not None:
            source.load(index, block)
        home = next(block.parameters()).device
        block.to(device)
        done = len(reports)
        names = [n for n in layers if n.startswith(f"{prefix}.{index}.")]
        accumulators = {n: make_accumulator(n, layers[n]) for n in names}
        _observe(block, index, {n: layers[n] for n in names}, accumulators, hidden, batches)
        held = (
            hidden.resident_bytes()
            + _nbytes([b["kwargs"][index] for b in batches])
            + _nbytes([vars(a) for a in accumulators.values()])
        )
        stats.peak_state_bytes = max(stats.peak_state_bytes, held)
        if names:
            if compress_block is not None:
                reports.extend(compress_block(index, block, names, accumulators, batches))
            else:
                for n in names:  # each layer's statistics freed once it is compressed
                    reports.append(compress_layer(n, layers[n], accumulators.pop(n)))
        for i, batch in enumerate(batches):  # the compressed block's outputs feed the next
            hidden[i] = _first(block(hidden[i], *batch["args"][index], **batch["kwargs"][index]))
        del accumulators
        block.to(home)
        if source is not None:
            source.release(index, block, reports[done:])
        stats.per_block_seconds.append(time.perf_counter() - block_start)
    _to_device(model, home_device)
    model.train(was_training)
    stats.seconds = time.perf_counter() - start
    return reports, stats


def _decoder_blocks(model: nn.Module, layers: dict[str, nn.Module]) -> tuple[str, nn.Module]:
    """``(name, module list)`` of the model's decoder blocks, which must hold every layer."""
    prefix = family_of(model).blocks
    outside = [name for name in layers if not name.startswith(prefix + ".")]
    if outside:
        raise ValueError(f"layer-wise calibration covers decoder blocks only, not {outside}")
    return prefix, model.get_submodule(prefix)


def _observe(
    block: nn.Module,
    index: int,
    layers: dict[str, nn.Module],
    accumulators: dict[str, Accumulator],
    hidden: _Activations,
    batches: list[dict[str, Any]],
) -> None:
    """Run block ``index`` over every batch with each layer's accumulator on its input (one
    accumulation for layers that share an input: :class:`SharedInputFeed`)."""
    if not layers:
        return
    feed = SharedInputFeed(accumulators)
    handles = [
        layers[n].register_forward_pre_hook(lambda _mod, args, _n=n: feed(_n, args[0]))
        for n in layers
    ]
    try:
        for i, batch in enumerate(batches):
            block(hidden[i], *batch["args"][index], **batch["kwargs"][index])
            feed.next_batch()
    finally:
        for handle in handles:
            handle.remove()


def layerwise_estimate(
    model: nn.Module,
    layers: dict[str, nn.Module],
    nsamples: int,
    seq_len: int,
    batch_size: int,
    itemsize: int = 4,
    state: dict[str, Callable[[nn.Module], int]] | None = None,
) -> dict[str, int]:
    """Peak bytes of :func:`compress_layerwise` beyond the weights, from shapes alone (a
    meta-device skeleton will do): every window's block inputs, one batch's transient block
    activations (attention probabilities included: CPU attention materialises them), and, per
    ``state`` entry, the largest block's sum of ``state[part](layer)`` over its layers."""
    config = model.config
    hidden = config.hidden_size
    intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
    heads = getattr(config, "num_attention_heads", 1)
    batch = min(batch_size, nsamples)
    parts = {
        "calibration activations": nsamples * seq_len * hidden * itemsize,
        "one block's forward": batch
        * seq_len
        * (6 * hidden + 3 * intermediate + 2 * heads * seq_len)
        * itemsize,
    }
    prefix = family_of(model).blocks + "."
    for part, nbytes in (state or {}).items():
        per_block: dict[str, int] = {}
        for name, module in layers.items():
            block = name.removeprefix(prefix).split(".", 1)[0]
            per_block[block] = per_block.get(block, 0) + nbytes(module)
        parts[part] = max(per_block.values(), default=0)
    return parts


def stream_blocks(
    model: nn.Module,
    source: BlockSource,
    compress: Callable[[int, nn.Module], list[LayerReport]],
    progress: bool = True,
) -> list[LayerReport]:
    """For methods that read no calibration data (magnitude): materialise each block of a
    meta-device skeleton from ``source``, ``compress(index, block)`` it, release it."""
    blocks = model.get_submodule(family_of(model).blocks)
    reports: list[LayerReport] = []
    for index in tqdm(
        range(len(blocks)), desc="blocks", unit="block", disable=bar_disabled(progress)
    ):
        source.load(index, blocks[index])
        done = len(reports)
        reports.extend(compress(index, blocks[index]))
        source.release(index, blocks[index], reports[done:])
    return reports
