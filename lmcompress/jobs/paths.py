"""The disk space a job writes: what it writes fits the free space of each filesystem
(:func:`disk_needs`, :func:`check_space`). :mod:`lmcompress.jobs.preflight` calls them before
any weight is read, beside the checks that every directory can be written
(:func:`lmcompress.compressor.util.paths.check_writable`, the output's in
:class:`lmcompress.compressor.io.output.OutputDir`); a disk that fills anyway is one line
(``fsutil``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from lmcompress.cache import cache_dir
from lmcompress.compressor.method import Method
from lmcompress.compressor.model.budget import param_bytes
from lmcompress.compressor.model.checkpoint import ALIASES
from lmcompress.compressor.model.loading import resolve_dtype
from lmcompress.compressor.util.fsutil import format_bytes, free_bytes
from lmcompress.compressor.util.paths import shown_path
from lmcompress.errors import ConfigError
from lmcompress.jobs.options import RunOptions

logger = logging.getLogger(__name__)


@dataclass
class DiskNeed:
    """Bytes a job will write under ``path`` (``what``: the flag that names it)."""

    path: str
    what: str
    bytes: int


def disk_needs(
    skeleton: nn.Module, options: RunOptions, method: Method, selected: dict[str, nn.Module]
) -> list[DiskNeed]:
    """What the job writes, by where: the export (every weight at the save dtype, plus the
    compressed layers, at most their dense size, beside the dense copy, plus the learned
    tensors kept), the offloaded activations (the hidden states of every calibration window,
    twice: a block's inputs and outputs), the model cache (the alias's fp32 copy)."""
    needs = []
    dtype = options.dtype if options.save_dtype == "auto" else options.save_dtype
    itemsize = resolve_dtype(dtype).itemsize
    if options.output:
        layers = sum(p.numel() for m in selected.values() for p in m.parameters(recurse=False))
        size = param_bytes(skeleton, itemsize) + method.stats_bytes(skeleton)
        if options.dense_copy:
            size += layers * itemsize
        size += _tokenizer_bytes(options.checkpoint) + EXPORT_EXTRAS_BYTES
        needs.append(DiskNeed(options.output, "output", size))
    if options.offload_activations and method.needs_calibration:
        hidden = skeleton.config.hidden_size
        size = (
            2 * options.nsamples * options.seq_len * hidden * resolve_dtype(options.dtype).itemsize
        )
        needs.append(DiskNeed(options.offload_activations, "--offload-activations", size))
    if options.checkpoint in ALIASES and not (cache_dir() / options.checkpoint).is_dir():
        size = param_bytes(skeleton, 4)
        needs.append(DiskNeed(str(cache_dir()), "cache directory ($LMCOMPRESS_CACHE)", size))
    return needs


# an export's files besides the weights: model card, report.png, compression.json, config
EXPORT_EXTRAS_BYTES = 2 * 2**20
TOKENIZER_GUESS_BYTES = 8 * 2**20  # before the built-in model's first load: not yet on disk


def _tokenizer_bytes(checkpoint: str) -> int:
    """The bytes of the tokenizer files the export copies (a guess where they are not files
    yet: the built-in model before its first load, a hub id)."""
    directory = cache_dir() / checkpoint if checkpoint in ALIASES else Path(checkpoint)
    directory = directory.expanduser()
    if not directory.is_dir():
        return TOKENIZER_GUESS_BYTES
    return sum(
        path.stat().st_size
        for path in directory.iterdir()
        if path.is_file() and ("token" in path.name or path.name in TOKENIZER_EXTRAS)
    )


TOKENIZER_EXTRAS = ("vocab.json", "merges.txt", "chat_template.jinja", "special_tokens_map.json")


def check_space(needs: list[DiskNeed], force: bool = False) -> None:
    """Refuse, in one line with the numbers, a job whose writes do not fit the free space of
    their filesystems (writes to one filesystem add up); ``force``: warn and go on."""
    by_device: dict[int, list[DiskNeed]] = {}
    for need in needs:
        path = Path(need.path).expanduser().absolute()
        while not path.exists():
            path = path.parent
        by_device.setdefault(path.stat().st_dev, []).append(need)
    for group in by_device.values():
        total = sum(need.bytes for need in group)
        free = free_bytes(Path(group[0].path).expanduser())
        if total <= free:
            continue
        parts = " + ".join(
            f"{need.what} {shown_path(need.path)} {format_bytes(need.bytes)}" for need in group
        )
        message = (
            f"not enough disk space: the job writes about {format_bytes(total)} ({parts}) but "
            f"its filesystem has {format_bytes(free)} free"
        )
        if force:
            logger.warning("%s: going on (--force)", message)
            continue
        raise ConfigError(f"{message}; free space, write elsewhere, or pass --force to try anyway")
