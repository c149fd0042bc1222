"""Everything a job checks before it reads a weight: a bad input fails in about a second with one
line, never after minutes of loading, calibrating or compressing.

In order: the device exists; the checkpoint exists and is of a supported kind; the output path
can be written, is not the input (nor inside it, nor around it) and has no debris of a killed
run; the lm-eval tasks resolve; the model, built from its config on the meta device (shapes, no
memory), accepts the method (layer selection, N:M divisibility, per-layer overrides, the
method's files such as ``--resume``); ``seq_len`` fits the model's positions; the estimated
peak memory fits the machine; and the corpora exist. :func:`lmcompress.jobs.run.run` calls
:func:`preflight` first (for every stage); ``compress-model eval`` calls the parts that apply to
it (:func:`check_eval`).
"""

from __future__ import annotations

import errno
import logging
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from torch import nn

from lmcompress.compressor.io.save import check_output_dir
from lmcompress.compressor.io.shards import open_safetensors
from lmcompress.compressor.method import Method
from lmcompress.compressor.model.budget import (
    RUNTIME_BYTES,
    MemoryEstimate,
    check_fits,
    eval_bytes,
    param_bytes,
)
from lmcompress.compressor.model.checkpoint import (
    ALIASES,
    alias_gguf,
    check_checkpoint,
    max_positions,
    model_config,
)
from lmcompress.compressor.model.loading import check_device, model_skeleton, resolve_dtype
from lmcompress.compressor.util.cache import cache_dir
from lmcompress.compressor.util.fsutil import format_bytes, free_bytes, sweep_stale
from lmcompress.errors import ConfigError, DataError, LmcompressError, ModelLoadError
from lmcompress.evaluation.corpora import load_documents
from lmcompress.evaluation.lm_eval_adapter import check_tasks
from lmcompress.jobs.options import RunOptions
from lmcompress.jobs.streaming import check_streaming, streaming_weight_bytes

logger = logging.getLogger(__name__)


@dataclass
class DiskNeed:
    """Bytes a job will write under ``path`` (``what``: the flag that names it)."""

    path: str
    what: str
    bytes: int


@dataclass
class Plan:
    """What the checks learnt, for the job to use: the model's config and skeleton, and the
    memory estimate it was admitted with."""

    skeleton: nn.Module
    estimate: MemoryEstimate
    memory_line: str = ""  # logged once every check has passed
    disk: list[DiskNeed] = field(default_factory=list)  # what the job writes, by where


def preflight(options: RunOptions, method: Method) -> Plan:
    if options.streaming:
        check_streaming(options, method)
    device = check_device(options.device)
    check_checkpoint(options.checkpoint)
    if options.output is not None:
        check_output(options.output, options.overwrite, _inputs(options, method))
    for path, what in _work_dirs(options, method):
        check_writable(path, what)
    if options.lm_eval_tasks:
        check_tasks(list(options.lm_eval_tasks))
    config = model_config(options.checkpoint, trust_remote_code=options.trust_remote_code)
    check_seq_len(options.seq_len, config)
    if options.eval and 0 < options.eval_tokens < options.seq_len:
        raise ConfigError(
            f"eval_tokens {options.eval_tokens} is fewer than one window of seq_len "
            f"{options.seq_len}: use at least {options.seq_len}, or 0 for the whole corpus"
        )
    if options.streaming:  # the skeleton the streamed job compresses: real buffers, its dtype
        skeleton = model_skeleton(config, options.dtype, options.trust_remote_code, True)
    else:
        skeleton = model_skeleton(config)
    check_weight_shapes(options.checkpoint, skeleton)
    selected = method.validate(skeleton)
    text = [  # a misspelt or too short corpus fails before the model loads
        check_corpus_length(source, options.seq_len, "evaluation corpus") for source in options.eval
    ]
    if method.needs_calibration:
        text.append(check_corpus_length(options.calib, options.seq_len + 1, "calibration corpus"))
    estimate = estimate_job(skeleton, options, method, text)
    memory_line = check_fits(estimate, device, force=options.force)
    disk = disk_needs(skeleton, options, method, selected)
    check_space(disk, force=options.force)
    return Plan(skeleton=skeleton, estimate=estimate, memory_line=memory_line, disk=disk)


def _inputs(options: RunOptions, method: Method) -> list[Path]:
    """The local paths the job reads (and must not overwrite)."""
    paths = checkpoint_paths(options.checkpoint)
    prior_from = getattr(method.config, "prior_from", None)
    if prior_from:
        paths.append(Path(prior_from))
    training = getattr(method.config, "training", None)
    if training is not None and training.checkpoint_dir:
        paths.append(Path(training.checkpoint_dir))
    return paths


def check_output(output: str | os.PathLike, overwrite: bool, inputs: list[Path]) -> None:
    """The output directory can be created or replaced, and replacing it destroys no input.

    Refused: an output equal to an input, inside one, or containing one (``--overwrite``
    replaces the whole directory); a path that cannot be written (:func:`check_writable`: an
    empty ``-o``, a dangling or looping symlink, a name too long, a path under a file, a
    parent that cannot be written). Debris of a killed run next to the output
    (``.OUT.tmp-*``) is removed here."""
    out = check_writable(output, "output", inside=False)
    for path in inputs:
        source = path.expanduser().resolve()
        if out == source:
            relation = "is"
        elif out.is_relative_to(source):
            relation = "is inside"
        elif source.is_relative_to(out):
            relation = "contains"
        else:
            continue
        raise ConfigError(
            f"output {output} {relation} the input {path}: writing it would destroy the "
            "input (even with --overwrite); choose another -o"
        )
    if out.exists():
        check_output_dir(out, overwrite)
    if out.parent.is_dir():
        sweep_stale(out)


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


def _work_dirs(options: RunOptions, method: Method) -> list[tuple[str, str]]:
    """The directories besides the output that the job writes into: ``--offload-activations``,
    a learned method's ``--checkpoint-dir``, and the cache when the model's safetensors copy
    is to be made there."""
    dirs = []
    if options.offload_activations is not None:
        dirs.append((options.offload_activations, "--offload-activations"))
    training = getattr(method.config, "training", None)
    if training is not None and training.checkpoint_dir and training.checkpoint_every:
        dirs.append((training.checkpoint_dir, "--checkpoint-dir"))
    if options.checkpoint in ALIASES and not (cache_dir() / options.checkpoint).is_dir():
        dirs.append((cache_dir(), "cache directory ($LMCOMPRESS_CACHE)"))
    return dirs


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


def check_seq_len(seq_len: int, config) -> None:
    limit = max_positions(config)
    if limit is not None and seq_len > limit:
        raise ConfigError(
            f"seq_len {seq_len} exceeds the model's maximum of {limit} positions "
            f"({config.model_type}); use --seq-len {limit} or less"
        )


# Tokenizing a corpus as one text (the perplexity protocol) with a fast tokenizer: measured on
# SmolLM2's, wiki-calib (2.01 MB of text, 448k tokens) peaks 298 MB above where it started
# (~148 bytes per byte of text: the encoding's offsets and masks, the Python list of ids), and
# 126 MB stay with the process after the ids are freed (the tokenizer's caches, the heap).
TOKENIZING_BYTES_PER_BYTE = 150
TOKENIZED_BYTES_PER_BYTE = 64


def estimate_job(
    skeleton: nn.Module, options: RunOptions, method: Method, text_bytes: Sequence[int] = ()
) -> MemoryEstimate:
    """Peak bytes of the job: the weights and libraries throughout, what tokenizing the
    corpora (``text_bytes``: each one's UTF-8 size) leaves behind, plus the largest of the
    method's own peak, one evaluation batch's and tokenizing the largest corpus (they never
    overlap)."""
    itemsize = resolve_dtype(options.dtype).itemsize
    weights = param_bytes(skeleton, itemsize)
    if options.streaming:  # one block (or the embeddings) at a time
        weights = streaming_weight_bytes(skeleton, itemsize)
    estimate = MemoryEstimate({"model weights": weights, "torch and libraries": RUNTIME_BYTES})
    if text_bytes:
        estimate = estimate.add(
            {"token ids and the tokenizer's leftovers": TOKENIZED_BYTES_PER_BYTE * sum(text_bytes)}
        )
    nsamples = options.nsamples if method.needs_calibration else 0
    phases = [method.memory_estimate(skeleton, nsamples, options.seq_len, itemsize)]
    if text_bytes:
        phases.append({"tokenizing a corpus": TOKENIZING_BYTES_PER_BYTE * max(text_bytes)})
    if options.eval and not options.streaming:
        phases.append(
            {
                "evaluation batch": eval_bytes(
                    skeleton, options.eval_batch_size, options.seq_len, itemsize
                )
            }
        )
    return estimate.add(max(phases, key=lambda parts: sum(parts.values())))


def check_corpus_length(source: str, tokens: int, what: str) -> int:
    """Read ``source`` (a one-line error if it cannot be) and refuse it when it cannot hold
    ``tokens`` tokens, before the model loads. A tokenizer makes at most one token per UTF-8
    byte, plus one word-start piece per word for SentencePiece's (``"▁"``, ``"1"``): fewer
    than 2 tokens a byte, so a text shorter than half a window in bytes is surely too short
    (a longer one that still is fails when it is tokenized)."""
    size = len("\n\n".join(load_documents(source)).encode())
    if 2 * size + 1 < tokens:
        raise DataError(
            f"the {what} {shown_path(source)} has {size} bytes of text: too short for one "
            f"window of {tokens} tokens; use a larger corpus or a shorter --seq-len"
        )
    return size


def check_eval(checkpoint: str, device: str, seq_len: int, tasks: list[str], corpora) -> None:
    """The checks of ``compress-model eval``: device, checkpoint, tasks, positions, corpora."""
    check_device(device)
    check_checkpoint(checkpoint)
    if tasks:
        check_tasks(tasks)
    check_seq_len(seq_len, model_config(checkpoint))
    for source in corpora:
        check_corpus_length(source, seq_len, "evaluation corpus")


def checkpoint_paths(checkpoint: str) -> list[Path]:
    """The local files a checkpoint is read from: its directory or GGUF file; for an alias, the
    cached safetensors copy and the packaged GGUF."""
    if checkpoint in ALIASES:
        paths = [cache_dir() / checkpoint]
        try:
            paths.append(alias_gguf(checkpoint))
        except LmcompressError:  # not installed: check_checkpoint said so already
            pass
        return paths
    path = Path(checkpoint).expanduser()
    return [path] if path.exists() else []
