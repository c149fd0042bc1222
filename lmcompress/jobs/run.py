"""One compression job end to end: check, load, calibrate, compress, evaluate, export.

Every job is a list of stages run on one model: a single-method run is a job of one stage, a
multi-stage recipe (:mod:`lmcompress.jobs.recipe`) one of several. Where the model is comes
from a *target*: :class:`InMemoryModel` (loaded whole, evaluated, saved at the end), or, with
``--streaming``, :class:`~lmcompress.jobs.streaming.StreamedModel` (a skeleton whose blocks a
block source reads and writes one at a time; nothing is evaluated). The steps are the same.

The CLI is a thin layer over :func:`run`; benchmarks call it too, so every number the README
quotes comes through the same path a user runs.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from lmcompress.compressor.config import MethodConfig
from lmcompress.compressor.formats.compose import compose_, layers_to_skip
from lmcompress.compressor.io.output import OutputDir
from lmcompress.compressor.io.save import save_compressed
from lmcompress.compressor.method import Method, Stats
from lmcompress.compressor.model.loading import load_model
from lmcompress.compressor.options import command_line
from lmcompress.compressor.report import CompressionReport
from lmcompress.compressor.training import distributed
from lmcompress.compressor.util.arguments import one_or_more, path_argument, require
from lmcompress.errors import ConfigError, ModelLoadError
from lmcompress.evaluation.lm_eval_adapter import run_lm_eval
from lmcompress.evaluation.speed import SpeedOptions
from lmcompress.jobs.bench import bench_into_export
from lmcompress.jobs.evaluate import JobText, evaluate
from lmcompress.jobs.options import RunOptions
from lmcompress.jobs.preflight import output_of
from lmcompress.jobs.recipe import check_stages, recipe_of, stage_method
from lmcompress.jobs.streaming import StreamedModel
from lmcompress.methods import get_method

logger = logging.getLogger(__name__)


class Target(Protocol):
    """Where a job's model is: ``model`` and ``tokenizer`` once entered, whether it can be
    ``evaluates``-d whole, how a method compresses it, and how the output is written (which
    records ``results["output"]``)."""

    evaluates: bool
    model: nn.Module
    tokenizer: Any

    def compress(
        self, method: Method, data: torch.Tensor | None
    ) -> tuple[CompressionReport, Stats]: ...

    def export(
        self, report: CompressionReport, results: dict[str, Any], stats: Stats | None
    ) -> None: ...


class InMemoryModel:
    """The target of a job whose model fits in memory: loaded whole with its tokenizer,
    evaluated before and after, written by :func:`save_compressed` at the end."""

    evaluates = True

    def __init__(self, options: RunOptions, output: OutputDir | None = None) -> None:
        self.options, self.output = options, output

    def __enter__(self) -> InMemoryModel:
        options = self.options
        self.model, self.tokenizer = load_model(
            options.checkpoint,
            dtype=options.dtype,
            device=options.device,
            trust_remote_code=options.trust_remote_code,
        )
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def compress(
        self, method: Method, data: torch.Tensor | None
    ) -> tuple[CompressionReport, Stats]:
        return method.compress(self.model, data)

    def export(
        self, report: CompressionReport, results: dict[str, Any], stats: Stats | None
    ) -> None:
        options = self.options
        save_dtype = None if options.save_dtype == "auto" else getattr(torch, options.save_dtype)
        save_compressed(
            self.model,
            self.output or OutputDir(options.output, options.overwrite),
            report,
            tokenizer=self.tokenizer,
            dtype=save_dtype,
            extra=results,
            stats=stats,
            dense_copy=options.dense_copy,
            exports=(options.export,) if options.export else (),
        )
        results["output"] = options.output


def run(
    options: RunOptions,
    config: MethodConfig | Sequence[MethodConfig],
    stages: bool | None = None,
    reads: Sequence[str | Path] = (),
) -> dict[str, Any]:
    """Run the job; returns the results that the CLI prints and ``compression.json`` records,
    and ``report`` (the combined :class:`CompressionReport`).

    ``config`` is one method's config, or one per stage; ``stages`` (default: a sequence was
    given) records the job as a multi-stage recipe (``results["stages"]``, one entry per stage);
    ``reads``: files read before the job (its recipe), which the output must not destroy.
    Every check that needs no weights runs first (:mod:`lmcompress.jobs.preflight`), so a bad
    input fails in about a second: device, checkpoint, output path, lm-eval tasks, each stage's
    method on a meta-device skeleton, sequence length, memory, corpora."""
    require("options", options, RunOptions, "a RunOptions(checkpoint=..., output=...)")
    configs = one_or_more("config", config, MethodConfig, "a method config (SparseGPTConfig(...))")
    stages = not isinstance(config, MethodConfig) if stages is None else stages
    if not configs:
        raise ConfigError("a recipe needs at least one stage")
    if options.streaming and len(configs) > 1:
        raise ConfigError("--streaming runs one method: it is not for a multi-stage recipe")
    # One object for the output directory: each of its rules is checked once (the lock, every
    # stage's preflight, the save). A second run writing the same output waits for nothing: it
    # is refused, naming the first. (An empty ``-o`` takes no lock: the preflight refuses it in
    # its place among the checks.)
    reads = [path_argument(f"reads[{i}]", path) for i, path in enumerate(reads)]
    output = output_of(options, reads)
    locked = output.lock() if output and options.output else contextlib.nullcontext()
    with locked:
        plan = check_stages(options, configs, output)
        logger.info("%s", plan.memory_line)
        if not options.output and distributed.is_main_process():
            logger.info(
                "no output directory: nothing is saved (add -o DIR, or RunOptions(output=DIR) "
                "from Python, to save the compressed model)"
            )
        start = time.perf_counter()
        if options.streaming:
            target: Target = StreamedModel(options, plan.skeleton, output)
        else:
            target = InMemoryModel(options, output)
        results = _new_results(options, configs, stages)
        # the peak the job was admitted with, beside what it did (benchmarks.memory_estimate
        # compares it with the measured peak RSS)
        results["memory_estimate"] = {"total": plan.estimate.total, "parts": plan.estimate.parts}
        # a full disk is one line, after the output's temporary directory is removed
        writing = output.guarded() if output and options.output else contextlib.nullcontext()
        with writing, target:
            return _run(target, options, configs, stages, results, start)


def _run(
    target: Target,
    options: RunOptions,
    configs: list[MethodConfig],
    stages: bool,
    results: dict[str, Any],
    start: float,
) -> dict[str, Any]:
    """The steps, the same for every target: text, dense score, the stages, their combined
    report, the compressed score and lm-eval tasks, the export (main process only)."""
    needs_text = (target.evaluates and options.eval) or any(
        get_method(c.method)(c).needs_calibration for c in configs
    )
    if target.tokenizer is None and needs_text:
        raise ModelLoadError(f"{options.checkpoint} has no tokenizer: cannot read text")
    text = JobText(target.tokenizer, options, evaluates=target.evaluates, model=target.model)
    # Under ``accelerate launch`` every process compresses (a learned method trains on its
    # share of the data); only the main one evaluates and writes the outputs.
    main = distributed.is_main_process()
    scores = target.evaluates and main
    if scores and not options.skip_dense:
        results["dense"] = evaluate(target.model, target.tokenizer, text.corpora, options)
    reports, kept = _compress_stages(target, configs, text, results, scores, stages)
    report = compose_(target.model, reports) if stages else reports[0]
    if not main:
        results.update(report=report, compressed={}, seconds=time.perf_counter() - start)
        return results
    if not target.evaluates:
        results["compressed"] = {}  # no corpus scored
    elif stages:
        results["compressed"] = results["stages"][-1]["compressed"]
    else:
        results["compressed"] = evaluate(target.model, target.tokenizer, text.corpora, options)
    if options.lm_eval_tasks:
        results["lm_eval"] = run_lm_eval(
            target.model, target.tokenizer, list(options.lm_eval_tasks)
        )
    results["summary"] = report.summary()
    results["seconds"] = time.perf_counter() - start
    if options.output:
        target.export(report, results, kept)  # and records results["output"]
        if options.bench:
            speed = _speed_options(options)
            results["speed"] = bench_into_export(options.checkpoint, options.output, speed)
    results["report"] = report
    return results


def _speed_options(options: RunOptions) -> SpeedOptions:
    """``--bench``'s settings: ``compress-model bench``'s defaults (prefill 4 × 256, 32 new
    tokens after a 64-token prompt), shortened to fit ``--seq-len`` (the job checked it against
    the model's positions)."""
    prompt = min(64, options.seq_len // 2)
    return SpeedOptions(
        prefill=(4, min(256, options.seq_len)),
        prompt=prompt,
        decode=min(32, options.seq_len - prompt - 1),
        device=options.device,
    )


def _new_results(options: RunOptions, configs: list[MethodConfig], stages: bool) -> dict[str, Any]:
    results: dict[str, Any] = {"options": asdict(options), "checkpoint": options.checkpoint}
    if stages:
        results["recipe"] = recipe_of(options, configs)
        results["command"] = "compress-model --config recipe.yaml" + (
            f" -o {options.output}" if options.output else ""
        )
        results["stages"] = []
    else:  # for the model card: the run again, whatever recipe or API call started it
        config = configs[0]
        results["command"] = command_line(
            "compress-model", options.checkpoint, config.method, options, config
        )
    return results


def _compress_stages(
    target: Target,
    configs: list[MethodConfig],
    text: JobText,
    results: dict[str, Any],
    scores: bool,
    stages: bool,
) -> tuple[list[CompressionReport], Stats | None]:
    """Each stage on the model as the earlier ones left it: ``(reports, stats to keep)``."""
    reports: list[CompressionReport] = []
    kept = None
    for index, config in enumerate(configs):
        keeps = get_method(config.method)(config).composes_after
        method, skipped = stage_method(target.model, configs, index, layers_to_skip(reports, keeps))
        method.validate(target.model)
        stage_start = time.perf_counter()
        data = text.calibration() if method.needs_calibration else None
        report, stats = target.compress(method, data)
        reports.append(report)
        if method.stats_in_output and (stats.tensors or not stages):
            kept = stats  # learned tensors (MaskLLM's logits): for --prior-from and inspection
        if not stages:
            continue
        report.config = config.to_dict()  # the stage as written, not with its skipped layers
        report.extra["skipped_layers"] = skipped
        stage = {
            "method": config.method,
            "config": report.config,
            "skipped_layers": len(skipped),
            "seconds": time.perf_counter() - stage_start,
            "summary": report.summary(),
            "report": report.to_dict(),
        }
        if scores:
            stage["compressed"] = evaluate(
                target.model, target.tokenizer, text.corpora, text.options
            )
        results["stages"].append(stage)
        logger.info(
            "stage %d/%d (%s): %d layers, %d skipped",
            *(index + 1, len(configs), config.method, len(report.layers), len(skipped)),
        )
    return reports, kept
