"""The paths and the disk space a job writes: every directory it creates or writes into can
be written (:func:`check_writable`), and what it writes fits the free space of each
filesystem (:func:`disk_needs`, :func:`check_space`); a local checkpoint's weights have the
shapes its config builds (:func:`check_weight_shapes`, from the safetensors headers).
:mod:`lmcompress.jobs.preflight` calls them before any weight is read; a disk that fills
anyway is one line (``fsutil``).
"""

from __future__ import annotations

import errno
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from lmcompress.cache import cache_dir
from lmcompress.compressor.io.shards import open_safetensors
from lmcompress.compressor.method import Method
from lmcompress.compressor.model.budget import param_bytes
from lmcompress.compressor.model.checkpoint import ALIASES
from lmcompress.compressor.model.loading import resolve_dtype
from lmcompress.compressor.util.fsutil import format_bytes, free_bytes
from lmcompress.errors import ConfigError, ModelLoadError
from lmcompress.jobs.options import RunOptions

logger = logging.getLogger(__name__)


PATH_SHOWN = 100  # characters of a path a message quotes whole


def shown_path(path: str | os.PathLike) -> str:
    """A path as a one-line message quotes it: whole up to :data:`PATH_SHOWN` characters,
    else its two ends and its length."""
    text = os.fspath(path)
    if len(text) <= PATH_SHOWN:
        return text
    return f"{text[:50]}…{text[-40:]} ({len(text)} characters)"


def check_writable(path: str | os.PathLike, what: str, inside: bool = True) -> Path:
    """The resolved directory ``path``, after checking that the job can create or write it:
    one-line :class:`ConfigError` s for an empty path (an unset variable), a name longer than
    the filesystem allows, a symlink loop, a dangling symlink (in any component), a path under
    a file, and a place that cannot be written. ``inside``: files go into the directory (a
    work directory), else beside it (an output, built in a temporary sibling and renamed).

    Writability is probed by creating and removing a directory in the nearest existing
    ancestor (this catches ``/proc``, read-only mounts and missing permissions without
    trusting ``os.access``)."""
    text = os.fspath(path)
    if not text.strip():
        flag = "-o" if what == "output" else what
        raise ConfigError(f"{flag} is empty (an unset variable?): name the {what} directory")
    shown = shown_path(text)
    raw = Path(text).expanduser().absolute()
    limit = os.pathconf("/", "PC_NAME_MAX") if hasattr(os, "pathconf") else 255
    if any(len(os.fsencode(part)) > limit for part in raw.parts):
        raise ConfigError(f"{what} {shown}: a name in it is longer than {limit} bytes")
    try:
        os.stat(raw)
    except FileNotFoundError:
        pass
    except NotADirectoryError:
        pass  # found below: which ancestor is a file
    except OSError as err:
        reason = {
            errno.ELOOP: "a symlink loop",
            errno.ENAMETOOLONG: "the path is longer than the system allows",
        }.get(err.errno, err.strerror or str(err))
        raise ConfigError(f"{what} {shown}: {reason}") from None
    ancestor = raw if inside else raw.parent
    while not ancestor.exists():
        if ancestor.is_symlink():
            raise ConfigError(
                f"{what} {shown}: {shown_path(ancestor)} is a dangling symlink (to "
                f"{shown_path(os.readlink(ancestor))}); remove it or choose another path"
            )
        ancestor = ancestor.parent
    if raw.is_symlink() and not raw.exists():
        raise ConfigError(
            f"{what} {shown} is a dangling symlink (to {shown_path(os.readlink(raw))}); "
            "remove it or choose another path"
        )
    if raw.exists() and not raw.is_dir():
        raise ConfigError(f"{what} {shown} exists and is not a directory")
    if not ancestor.is_dir():
        raise ConfigError(f"{what} {shown}: {shown_path(ancestor)} is a file, not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".lmcompress-probe-", dir=ancestor))
    except OSError as err:
        raise ConfigError(
            f"{what} {shown}: cannot write in {shown_path(ancestor)} ({err.strerror or err})"
        ) from None
    return raw.resolve()


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


def check_weight_shapes(checkpoint: str, skeleton: nn.Module) -> None:
    """A local checkpoint directory's safetensors hold the shapes its ``config.json`` builds:
    a one-line :class:`ModelLoadError` naming the first weight that disagrees (and how many
    do), before ``from_pretrained`` would print its load report. Reads the headers only."""
    directory = Path(checkpoint).expanduser()
    if not directory.is_dir():
        return
    expected = {key: tuple(t.shape) for key, t in skeleton.state_dict().items()}
    wrong = []
    for file in sorted(directory.glob("*.safetensors")):
        try:
            with open_safetensors(file) as handle:
                for key in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                    shape = tuple(handle.get_slice(key).get_shape())
                    if key in expected and shape != expected[key]:
                        wrong.append((key, shape, expected[key]))
        except ModelLoadError as err:  # a truncated or foreign file: its header says so
            raise ModelLoadError(f"{checkpoint}: corrupt or unreadable weights: {err}") from None
    if wrong:
        key, found, built = wrong[0]
        more = f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
        raise ModelLoadError(
            f"{checkpoint}: config.json disagrees with the weights: {key} is {list(found)} in "
            f"the safetensors but {list(built)} by config.json{more}; fix config.json or "
            "use the checkpoint it belongs to"
        )
