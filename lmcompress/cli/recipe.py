"""``compress-model --config recipe.yaml`` for a recipe with ``stages:``
(:mod:`lmcompress.jobs.recipe`):
flags override the recipe's job options; each method's options live in its stage."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lmcompress.errors import ConfigError


def run_stages_job(args: dict[str, Any], flags: Any) -> int:
    """Run the multi-stage recipe ``flags.recipe`` with the job flags in ``args`` (the parsed
    flags of :func:`lmcompress.cli.main.add_job_arguments`); print its summary."""
    from lmcompress.compressor.options import flag_name
    from lmcompress.compressor.training import distributed
    from lmcompress.jobs.recipe import parse_recipe, run_recipe
    from lmcompress.jobs.run import RunOptions

    shared, configs = parse_recipe(flags.recipe, flags.run_fields)
    method_flags = sorted(set(args) & set(flags.method_fields) - set(flags.run_fields))
    if method_flags:
        raise ConfigError(
            f"{flag_name(method_flags[0])}: a multi-stage recipe takes each method's options "
            "in its stages, not as flags"
        )
    run_keys = (*flags.run_fields, "checkpoint")
    options = RunOptions(**{**shared, **{k: v for k, v in args.items() if k in run_keys}})
    results = run_recipe(options, configs)
    if distributed.is_main_process():
        print_summary(results)
    return 0


def print_summary(results: dict[str, Any]) -> None:
    """One row per corpus and stage: the perplexity after each stage, then bytes per stage."""
    stages = results["stages"]
    print(f"\n{len(stages)} stages on {results['checkpoint']}: {results['report'].method}")
    corpora = list(results.get("compressed") or {})
    if corpora:
        heads = ["dense", *(f"{i}:{s['method']}" for i, s in enumerate(stages, 1))]
        print(f"{'corpus':<14}" + "".join(f"{h:>16}" for h in heads))
        for corpus in corpora:
            dense = results.get("dense", {}).get(corpus)
            cells = [f"{dense['perplexity']:.3f}" if dense else "-"]
            cells += [f"{s['compressed'][corpus]['perplexity']:.3f}" for s in stages]
            print(f"{corpus:<14}" + "".join(f"{c:>16}" for c in cells))
    else:
        print("no corpus scored (--eval with none)")
    for index, stage in enumerate(stages, 1):
        summary = stage["summary"]
        print(
            f"stage {index} ({stage['method']}): {summary['layers']} layers in "
            f"{stage['seconds']:.1f} s, {stage['skipped_layers']} left to earlier stages"
        )
    total = results["summary"]
    print(
        f"{total['layers']} layers compressed in {results['seconds']:.1f} s; their stored form "
        f"takes {total['bytes_compressed'] / max(total['bytes_dense'], 1):.1%} of their dense "
        f"{results['options']['dtype']} bytes"
    )
    if results.get("output"):
        from lmcompress.cli.main import _output_sizes

        print(f"saved to {results['output']}: {_output_sizes(Path(results['output']))}")
