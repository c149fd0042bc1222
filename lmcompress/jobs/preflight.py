"""Everything a job checks before it reads a weight: a bad input fails in about a second with one
line, never after minutes of loading, calibrating or compressing.

In order: the device exists; the checkpoint exists and is of a supported kind; the output
directory's rules (:class:`~lmcompress.compressor.io.output.OutputDir`: it can be written, is
not the input, nor inside it, nor around it, is empty unless ``--overwrite``, has no debris of
a killed run); the lm-eval tasks resolve; the model, built from its config on the meta device
(shapes, no memory), accepts the method (layer selection, N:M divisibility, per-layer
overrides, the method's files such as ``--resume``); ``seq_len`` fits the model's positions;
the estimated peak memory fits the machine; and the corpora exist.
:func:`lmcompress.jobs.run.run` calls :func:`preflight` first (for every stage, one
``OutputDir`` for all); ``compress-model eval`` calls the parts that apply to it
(:func:`check_eval`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from torch import nn

from lmcompress.cache import cache_dir
from lmcompress.compressor.io.output import OutputDir
from lmcompress.compressor.io.shards import check_weight_shapes
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
from lmcompress.compressor.options import literal_choices, option_fields, option_value
from lmcompress.compressor.util.paths import check_writable, shown_path
from lmcompress.errors import ConfigError, DataError, LmcompressError
from lmcompress.evaluation.corpora import load_documents
from lmcompress.evaluation.generated import SELF_CORPUS
from lmcompress.evaluation.lm_eval_adapter import check_tasks
from lmcompress.jobs.options import RunOptions
from lmcompress.jobs.paths import DiskNeed, check_space, disk_needs
from lmcompress.jobs.streaming import check_streaming, streaming_weight_bytes

logger = logging.getLogger(__name__)


@dataclass
class Plan:
    """What the checks learnt, for the job to use: the model's config and skeleton, and the
    memory estimate it was admitted with."""

    skeleton: nn.Module
    estimate: MemoryEstimate
    memory_line: str = ""  # logged once every check has passed
    disk: list[DiskNeed] = field(default_factory=list)  # what the job writes, by where
    output: OutputDir | None = None  # checked; the job writes it


def output_of(options: RunOptions, reads: Sequence[str | Path] = ()) -> OutputDir | None:
    """The job's output directory (``None``: nothing is saved); ``reads``: the files read
    before the job started (the recipe), protected as its inputs are."""
    if options.output is None:
        return None
    return OutputDir(options.output, options.overwrite, [Path(p) for p in reads])


def preflight(options: RunOptions, method: Method, output: OutputDir | None = None) -> Plan:
    """Every check of one stage that needs no weights; ``output``: the job's (default: a new
    one for ``options.output``), whose rules are checked once however many stages share it."""
    if options.streaming:
        check_streaming(options, method)
    device = check_device(options.device)
    check_checkpoint(options.checkpoint)
    output = output or output_of(options)
    if output is not None:
        output.check(_inputs(options, method))
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
    if method.needs_calibration and options.calib != SELF_CORPUS:  # self: sampled, no text
        text.append(check_corpus_length(options.calib, options.seq_len + 1, "calibration corpus"))
    estimate = estimate_job(skeleton, options, method, text)
    memory_line = check_fits(estimate, device, force=options.force)
    disk = disk_needs(skeleton, options, method, selected)
    check_space(disk, force=options.force)
    return Plan(skeleton, estimate, memory_line, disk, output)


def _inputs(options: RunOptions, method: Method) -> list[Path]:
    """The local paths the job reads (and must not overwrite): the checkpoint's files, and
    every option of the job and of the method, whatever its name, whose value (or one of whose
    values) names an existing file or directory (``--eval``, ``--calib``, ``--prior-from``,
    ``--checkpoint-dir``, ...), the output itself and fixed choices aside."""
    paths = checkpoint_paths(options.checkpoint)
    for config in (options, method.config):
        for option in option_fields(type(config)):
            if option.name in ("output", "checkpoint") or literal_choices(option.hint):
                continue
            value = option_value(config, option)
            for text in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(text, str) and text.strip() and os.path.lexists(_local(text)):
                    paths.append(_local(text))
    return paths


def _local(text: str) -> Path:
    return Path(text).expanduser()


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
