"""``compress-model [CHECKPOINT] --method M ...``: the compression job's flags, and the job.

``compress-model`` and ``optimum-cli lmcompress`` both build their parser here
(:func:`add_job_arguments`), so the two take the same options, and run the job the flags and
the recipe describe (:func:`run_job`) through :func:`lmcompress.jobs.run.run`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lmcompress.cli.flags import add_dataclass_flags
from lmcompress.cli.summary import print_stages_summary, print_summary
from lmcompress.cli.terminal import PROG, Parser, setup_logging
from lmcompress.compressor.method import Method
from lmcompress.compressor.training import distributed
from lmcompress.errors import ConfigError
from lmcompress.jobs.options import RunOptions
from lmcompress.jobs.recipe import is_multi_stage, job_from, load_recipe
from lmcompress.jobs.run import run
from lmcompress.methods import METHODS, get_method


@dataclass(frozen=True)
class JobFlags:
    """What :func:`run_job` needs besides the parsed flags: the recipe the flags override and
    the method whose options the parser defined."""

    recipe: dict[str, Any]
    method_class: type[Method]
    recipe_path: str | None = None  # read before the job: protected as its inputs are


def add_job_arguments(
    parser: argparse.ArgumentParser, argv: Sequence[str], prog: str = PROG
) -> JobFlags:
    """Define a compression job's flags on ``parser``: the job's (:class:`RunOptions`) and the
    options of the method ``argv`` names (``--method``, else the recipe's, else magnitude).
    Raises ``ConfigError`` for an unknown method or unreadable recipe."""
    # First pass: which method (from the flag or the recipe) decides which flags exist.
    pre = Parser(add_help=False)
    pre.add_argument("--method")
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    recipe = load_recipe(known.config) if known.config else {}
    if is_multi_stage(recipe) and known.method:
        raise ConfigError("--method does not go with a multi-stage recipe: its stages name them")
    method_name = known.method or recipe.get("method") or "magnitude"
    method_class = get_method(method_name)

    parser.description = (
        "Compress a Hugging Face causal LM, score it beside the dense one, and write it as "
        "safetensors (with a model card, README.md, and report.png)."
    )
    parser.epilog = (
        f"The options above are {method_name}'s; each method has its own: "
        f"`{prog} --method NAME --help`, or `{PROG} methods` for all of them. Other commands: "
        f"`{PROG} eval OUT` scores a written output, `{PROG} bench CHECKPOINT OUT` times it. "
        "Exit codes: 0 done, 2 a bad input (one "
        "line, nothing written), 130 interrupted, 143 terminated."
    )
    parser.add_argument(
        "checkpoint",
        nargs="?",
        default=argparse.SUPPRESS,
        help="local dir, .gguf file, hub id, or smollm2-135m (default)",
    )
    parser.add_argument(
        "--method",
        default=method_name,
        choices=list(METHODS),
        help=f"compression method (default: magnitude; this help: {method_name})",
    )
    parser.add_argument("--config", help="YAML/JSON recipe; flags override it")
    parser.add_argument("-q", "--quiet", action="store_true", help="warnings only")
    run_group = parser.add_argument_group("job")
    add_dataclass_flags(run_group, RunOptions, skip=("checkpoint",), aliases={"output": "-o"})
    method_group = parser.add_argument_group(f"{method_name} options")
    add_dataclass_flags(method_group, method_class.config_class)
    return JobFlags(recipe, method_class, known.config)


def run_job(args: dict[str, Any], flags: JobFlags) -> int:
    """Run the job that ``args`` (the flags :func:`add_job_arguments` defined, as a dict) and
    the recipe describe, and print its summary."""
    given = dict(args)
    setup_logging(given.pop("quiet"))
    given.pop("config", None)
    stages = is_multi_stage(flags.recipe)
    options, configs = job_from(flags.recipe, given, flags.method_class)
    reads = [flags.recipe_path] if flags.recipe_path else []
    results = run(options, configs, stages=stages, reads=reads)
    if distributed.is_main_process():  # one summary, not one per process
        (print_stages_summary if stages else print_summary)(results)
    return 0


def compress(argv: Sequence[str]) -> int:
    parser = Parser(prog=PROG)
    flags = add_job_arguments(parser, argv)
    return run_job(vars(parser.parse_args(argv)), flags)
