"""Multi-stage recipes: several methods run one after another on one model, in one job.

A recipe with a ``stages:`` list (YAML or JSON) names a method and its options per stage; the
other top-level keys are the job's options (:class:`~lmcompress.jobs.run.RunOptions`: checkpoint,
calibration, evaluation, output) and hold for every stage::

    checkpoint: smollm2-135m
    nsamples: 32
    eval: [wiki-test, lee]
    stages:
      - {method: sparsegpt, sparsity: "2:4"}
      - {method: int8}

Each stage calibrates on, and compresses, the model as the earlier stages left it, with its own
``include`` / ``exclude``. A layer an earlier stage compressed is left alone by a later stage
unless the two compose (:mod:`lmcompress.compressor.formats.compose`): int8 after N:M or
unstructured
pruning keeps the zeros and is stored packed (``nm_packed_int8``); pruning after a low-rank
stage prunes only the layers the low-rank stage did not factorise ("on the rest"). A stage left
with no layer at all is an error, found before any weight is read where the model's skeleton
tells.

The job scores the dense model once, then the model after every stage (one report per stage,
``results["stages"]``), and writes one export whose ``report`` is the stages' combined report.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

from torch import nn

from lmcompress.api import run_method
from lmcompress.compressor.config import MethodConfig
from lmcompress.compressor.formats.base import CompressedLinear
from lmcompress.compressor.formats.compose import compose_, layers_to_skip
from lmcompress.compressor.method import Method
from lmcompress.compressor.model.families import family_of
from lmcompress.compressor.model.loading import load_model
from lmcompress.compressor.model.surgery import is_linear
from lmcompress.compressor.options import option_fields, option_value, recipe_value
from lmcompress.compressor.report import CompressionReport
from lmcompress.compressor.training import distributed
from lmcompress.errors import ConfigError, LmcompressError
from lmcompress.evaluation.corpora import calibration_windows, tokenize
from lmcompress.jobs.preflight import preflight
from lmcompress.jobs.run import RunOptions, evaluate, finish_run
from lmcompress.methods import get_method

logger = logging.getLogger(__name__)

# The methods whose result keeps an earlier stage's zeros, and the earlier layer formats they
# compose with (``None``: unstructured zeros in the dense weight). Keyed by method name because
# the method protocol does not declare it (a ``Method`` class attribute would be its home).
COMPOSES_AFTER: dict[str, frozenset[str | None]] = {"int8": frozenset({"nm_packed", None})}
# Run options that make no sense per stage or across stages.
_NOT_IN_RECIPES = ("streaming", "offload_activations")


def is_multi_stage(recipe: Mapping[str, Any]) -> bool:
    return "stages" in recipe


def parse_recipe(
    recipe: Mapping[str, Any], run_fields: Sequence[str]
) -> tuple[dict[str, Any], list[MethodConfig]]:
    """``(job options, stage configs)`` of a multi-stage recipe (keys already ``_``-spelt).

    One-line :class:`ConfigError` s for a malformed list, an unknown method, a stage's bad
    option (named with the stage's number), or a job option inside a stage."""
    if "method" in recipe:
        raise ConfigError("a recipe has either method (one stage) or stages, not both")
    stages = recipe["stages"]
    if not isinstance(stages, list) or not stages:
        raise ConfigError("recipe stages must be a non-empty list of mappings with a method")
    shared = {k: v for k, v in recipe.items() if k != "stages"}
    unknown = sorted(set(shared) - {*run_fields, "checkpoint"})
    if unknown:
        raise ConfigError(f"recipe has unknown job option(s): {', '.join(unknown)}")
    configs = []
    for index, stage in enumerate(stages, 1):
        if not isinstance(stage, Mapping) or not isinstance(stage.get("method"), str):
            raise ConfigError(f"recipe stage {index} must be a mapping with a method name")
        values = {str(k).replace("-", "_"): v for k, v in stage.items()}
        where = f"recipe stage {index} ({values['method']})"
        job = sorted(set(values) & {*run_fields, "checkpoint"})
        if job:
            raise ConfigError(
                f"{where}: {', '.join(job)} is a job option; set it at the top of the recipe, "
                "for every stage"
            )
        try:
            configs.append(get_method(values["method"]).config_class.from_dict(values))
        except ConfigError as err:
            raise ConfigError(f"{where}: {err}") from None
    for name in _NOT_IN_RECIPES:
        if shared.get(name):
            raise ConfigError(f"{name} runs one method: it is not for a multi-stage recipe")
    return shared, configs


def recipe_of(options: RunOptions, configs: Sequence[MethodConfig]) -> dict[str, Any]:
    """The recipe that runs the job again: the job's options and each stage's that differ
    from their defaults (the output path left out)."""
    return {
        **_changed(options, skip=("output", "overwrite")),
        "stages": [{"method": c.method, **_changed(c)} for c in configs],
    }


def _changed(config: Any, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    changed = {}
    for option in option_fields(type(config)):
        value = recipe_value(option_value(config, option))
        default = option.default
        if option.name in skip:
            continue
        if default is dataclasses.MISSING or value != recipe_value(default):
            changed[option.name] = value
    return changed


def _matching(model: nn.Module, config: MethodConfig) -> dict[str, nn.Module]:
    """The layers ``config``'s own patterns name, linear or already compressed."""
    include = tuple(config.include) or (f"{family_of(model).blocks}.*",)
    return {
        name: module
        for name, module in model.named_modules()
        if (is_linear(module) or isinstance(module, CompressedLinear))
        and any(fnmatch.fnmatchcase(name, p) for p in include)
        and not any(fnmatch.fnmatchcase(name, p) for p in config.exclude)
    }


def stage_method(
    model: nn.Module, configs: Sequence[MethodConfig], index: int, skip: Sequence[str]
) -> tuple[Method, list[str]]:
    """Stage ``index`` (0-based) as a method that leaves the ``skip`` layers alone, and the
    layers its patterns name that it skips; a :class:`ConfigError` if none is left to it."""
    config = configs[index]
    named = _matching(model, config)
    skip_set = set(skip)
    skipped = [
        name
        for name, module in named.items()
        if name in skip_set or isinstance(module, CompressedLinear)
    ]
    if named and len(skipped) == len(named):
        earlier = " + ".join(c.method for c in configs[:index])
        raise ConfigError(
            f"recipe stage {index + 1} ({config.method}) has no layer left: every layer it "
            f"selects was compressed by an earlier stage ({earlier}) and {config.method} does "
            "not compose with that; give it other layers (include/exclude)"
        )
    if skipped:
        config = dataclasses.replace(config, exclude=(*config.exclude, *skipped))
    return get_method(config.method)(config), skipped


def check_recipe(options: RunOptions, configs: Sequence[MethodConfig]) -> None:
    """:func:`~lmcompress.jobs.preflight.preflight` for every stage, before any weight is read.

    On the model's skeleton a later stage skips the layers an earlier one selects, unless it
    composes after some formats (:data:`COMPOSES_AFTER`): which format an earlier stage will
    store is known only once it ran, so such a stage is checked on all its layers here and
    again, exactly, when it starts."""
    plan = preflight(options, get_method(configs[0].method)(configs[0]))
    selected: list[str] = list(_matching(plan.skeleton, configs[0]))
    for index in range(1, len(configs)):
        skip = [] if configs[index].method in COMPOSES_AFTER else selected
        method, _ = stage_method(plan.skeleton, configs, index, skip)
        preflight(options, method)
        selected += list(method.validate(plan.skeleton))


def run_recipe(options: RunOptions, configs: Sequence[MethodConfig]) -> dict[str, Any]:
    """Run the stages ``configs`` in order on ``options.checkpoint``; returns the results that
    ``compression.json`` records (``results["stages"]``: one entry per stage, with its report
    and perplexities) plus ``report``, the combined :class:`CompressionReport`."""
    if not configs:
        raise ConfigError("a recipe needs at least one stage")
    if options.streaming:
        raise ConfigError("--streaming runs one method: it is not for a multi-stage recipe")
    check_recipe(options, configs)
    start = time.perf_counter()
    model, tokenizer = load_model(
        options.checkpoint,
        dtype=options.dtype,
        device=options.device,
        trust_remote_code=options.trust_remote_code,
    )
    if tokenizer is None:
        raise LmcompressError(f"{options.checkpoint} has no tokenizer: cannot read text")
    corpora = {
        name: tokenize(tokenizer, name, options.eval_tokens or None) for name in options.eval
    }
    calib = None  # tokenized when a stage first needs it
    results: dict[str, Any] = {
        "options": asdict(options),
        "checkpoint": options.checkpoint,
        "recipe": recipe_of(options, configs),
        "command": "compress-model --config recipe.yaml"
        + (f" -o {options.output}" if options.output else ""),
        "stages": [],
    }
    main = distributed.is_main_process()
    if not options.skip_dense and main:
        results["dense"] = evaluate(model, tokenizer, corpora, options)
    reports: list[CompressionReport] = []
    kept_stats = None
    for index, config in enumerate(configs):
        keeps = COMPOSES_AFTER.get(config.method, frozenset())
        method, skipped = stage_method(model, configs, index, layers_to_skip(reports, keeps))
        method.validate(model)
        stage_start = time.perf_counter()
        if method.needs_calibration and calib is None:
            calib = calibration_windows(
                tokenize(tokenizer, options.calib), options.nsamples, options.seq_len, options.seed
            )
        data = calib if method.needs_calibration else None
        report, stats = run_method(method, model, data, return_stats=True)
        report.config = config.to_dict()  # the stage as written, not with its skipped layers
        report.extra["skipped_layers"] = skipped
        reports.append(report)
        if method.stats_in_output and stats.tensors:
            kept_stats = stats
        stage = {
            "method": config.method,
            "config": report.config,
            "skipped_layers": len(skipped),
            "seconds": time.perf_counter() - stage_start,
            "summary": report.summary(),
            "report": report.to_dict(),
        }
        if main:
            stage["compressed"] = evaluate(model, tokenizer, corpora, options)
        results["stages"].append(stage)
        logger.info(
            "stage %d/%d (%s): %d layers, %d skipped",
            index + 1,
            len(configs),
            config.method,
            len(report.layers),
            len(skipped),
        )
    combined = compose_(model, reports)  # composed layers into their stored format
    if not main:
        results.update(report=combined, compressed={}, seconds=time.perf_counter() - start)
        return results
    results["compressed"] = results["stages"][-1]["compressed"]
    return finish_run(model, tokenizer, options, combined, results, kept_stats, start)
