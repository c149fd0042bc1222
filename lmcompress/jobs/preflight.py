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

import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from lmcompress.compressor.io.save import check_output_dir
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
from lmcompress.compressor.util.fsutil import sweep_stale
from lmcompress.errors import ConfigError, LmcompressError
from lmcompress.evaluation.corpora import load_documents
from lmcompress.evaluation.lm_eval_adapter import check_tasks
from lmcompress.jobs.options import RunOptions
from lmcompress.jobs.streaming import check_streaming, streaming_weight_bytes

logger = logging.getLogger(__name__)


@dataclass
class Plan:
    """What the checks learnt, for the job to use: the model's config and skeleton, and the
    memory estimate it was admitted with."""

    skeleton: nn.Module
    estimate: MemoryEstimate


def preflight(options: RunOptions, method: Method) -> Plan:
    if options.streaming:
        check_streaming(options, method)
    device = check_device(options.device)
    check_checkpoint(options.checkpoint)
    if options.output is not None:
        check_output(options.output, options.overwrite, _inputs(options, method))
    if options.lm_eval_tasks:
        check_tasks(list(options.lm_eval_tasks))
    config = model_config(options.checkpoint, trust_remote_code=options.trust_remote_code)
    check_seq_len(options.seq_len, config)
    if options.streaming:  # the skeleton the streamed job compresses: real buffers, its dtype
        skeleton = model_skeleton(config, options.dtype, options.trust_remote_code, True)
    else:
        skeleton = model_skeleton(config)
    method.validate(skeleton)
    estimate = estimate_job(skeleton, options, method)
    check_fits(estimate, device, force=options.force)
    for source in (*options.eval, *((options.calib,) if method.needs_calibration else ())):
        load_documents(source)  # a misspelt corpus fails before the model loads
    return Plan(skeleton=skeleton, estimate=estimate)


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
    replaces the whole directory); a path under a file; a parent that cannot be written (a
    probe directory is created and removed in the nearest existing ancestor: this catches
    ``/proc``, read-only mounts and missing permissions without trusting ``os.access``).
    Debris of a killed run next to the output (``.OUT.tmp-*``) is removed here. An empty
    ``-o`` (an unset ``$OUT`` in a script) is refused: it would otherwise read as the working
    directory here and as "save nothing" in the job."""
    if not str(output).strip():
        raise ConfigError("-o is empty (an unset variable?): name the output directory")
    out = Path(output).expanduser().resolve()
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
    ancestor = out
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ConfigError(f"output {output}: {ancestor} is a file, not a directory")
    if out.exists():
        check_output_dir(out, overwrite)
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".lmcompress-probe-", dir=ancestor))
    except OSError as err:
        raise ConfigError(
            f"output {output}: cannot write in {ancestor} ({err.strerror or err})"
        ) from None
    if out.parent.is_dir():
        sweep_stale(out)


def check_seq_len(seq_len: int, config) -> None:
    limit = max_positions(config)
    if limit is not None and seq_len > limit:
        raise ConfigError(
            f"seq_len {seq_len} exceeds the model's maximum of {limit} positions "
            f"({config.model_type}); use --seq-len {limit} or less"
        )


def estimate_job(skeleton: nn.Module, options: RunOptions, method: Method) -> MemoryEstimate:
    """Peak bytes of the job: the weights and libraries throughout, plus the larger of the
    method's own peak and one evaluation batch's (they never overlap)."""
    itemsize = resolve_dtype(options.dtype).itemsize
    weights = param_bytes(skeleton, itemsize)
    if options.streaming:  # one block (or the embeddings) at a time
        weights = streaming_weight_bytes(skeleton, itemsize)
    estimate = MemoryEstimate({"model weights": weights, "torch and libraries": RUNTIME_BYTES})
    nsamples = options.nsamples if method.needs_calibration else 0
    phases = [method.memory_estimate(skeleton, nsamples, options.seq_len, itemsize)]
    if options.eval and not options.streaming:
        phases.append(
            {
                "evaluation batch": eval_bytes(
                    skeleton, options.eval_batch_size, options.seq_len, itemsize
                )
            }
        )
    return estimate.add(max(phases, key=lambda parts: sum(parts.values())))


def check_eval(checkpoint: str, device: str, seq_len: int, tasks: list[str], corpora) -> None:
    """The checks of ``compress-model eval``: device, checkpoint, tasks, positions, corpora."""
    check_device(device)
    check_checkpoint(checkpoint)
    if tasks:
        check_tasks(tasks)
    check_seq_len(seq_len, model_config(checkpoint))
    for source in corpora:
        load_documents(source)


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
