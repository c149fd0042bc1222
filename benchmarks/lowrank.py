"""Low-rank compression of SmolLM2-135M: plain SVD, ASVD, SVD-LLM, FWSVD and GFWSVD (K-FAC and
nearest-Kronecker factors), at three ratios of parameters kept, with uniform and allocated ranks.

    python -m benchmarks.lowrank [--eval-tokens 16384]
    python -m benchmarks.lowrank --only "gfwsvd 0.8 greedy"     # rerun rows (stats are cached)
    python -m benchmarks.lowrank --render-only

Every linear in the decoder blocks; statistics from the dense model on 128 × 512 tokens of
``wiki-calib`` (seed 0), collected once per kind by a job of its own (wall time and peak RSS of
that job: one forward pass for ASVD and SVD-LLM, one gradient pass of 8 windows per backward
for FWSVD and both GFWSVD variants) and cached under ``--work``; each row then loads them,
factorises (``Method.apply``) and scores perplexity on ``wiki-test`` and ``lee`` (seq-len 512,
the library's evaluate step) in a process of its own (``benchmarks.child.lowrank``).
Rows with a variant (``refit``, ``sequential``, ``sequential+refit``, ``distill``) factorise
block by block on the compressed model with the calibration windows (``methods.svd.sequential``),
the ranks still from the cached dense statistics; ``distill`` then trains every factor pair one
epoch of the windows on the dense model's logits (``methods.svd.tuning``, in ``factorise s``);
``calib self``: the windows are sampled from the dense model (``--calib self``, the sampling
time inside ``factorise s``) rather than drawn from ``wiki-calib``; ``N windows``: the job draws
N windows of ``wiki-calib`` (``--nsamples N``) for the block-by-block pass and the distillation,
the statistics still the cached 128.
``combined`` factorises the MLP layers with GFWSVD and prunes the attention layers with
SparseGPT 2:4; ``gfwsvd 0.3 uniform + 2:4 residual`` (and ``greedy``) factorises with GFWSVD at
0.3 kept, then prunes each factorised layer's residual ``W − B A`` 2:4 with SparseGPT on the
compressed model's inputs (about 0.8 kept in all; ``factorise s`` both steps), beside
``sparsegpt 2:4`` alone on the same windows. ``cli`` runs ``compress-model --method gfwsvd``
end to end (gradient pass included) with the dense copy off, checks the size of
``compressed.safetensors`` against the kept parameters, and reloads it with ``compress-model
eval --runtime packed``; ``recipe`` does the same with ``recipes/gfwsvd80-distill.yaml`` (the
``512 windows`` row as one job: statistics on the first 128 windows, ``stats_nsamples``, the
rest on all 512).
Writes ``benchmarks/results/lowrank.{json,md}`` and ``lowrank_curves.png``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.harness import add_harness_args, add_merge_arg, merge_results, row_table, run_table
from benchmarks.lowrank_plot import plot, render
from benchmarks.render import RESULTS_DIR
from benchmarks.runner import CLI, PYTHON, STDOUT, Job, Run, run_job

NAME = "lowrank"
CORPORA = ("wiki-test", "lee")
CHECKPOINT = "smollm2-135m"
NSAMPLES, SEQ_LEN, SEED = 128, 512, 0
# GFWSVD at 0.3 kept (uniform or greedy ranks), every factorised layer's residual W - BA pruned
# 2:4 by SparseGPT: about 0.8 of the parameters kept in all, beside SparseGPT 2:4 alone
RESIDUAL = "gfwsvd 0.3 {} + 2:4 residual"
RECIPE = "recipes/gfwsvd80-distill.yaml"  # the ``recipe`` row: the best row, as a user runs it
# rows of one ``compress-model`` job end to end (gradient pass included), then the packed reload
END_TO_END = {
    "cli": (CHECKPOINT, "--method", "gfwsvd", "--ratio", "0.8", "--nsamples", "32",
            "--seq-len", str(SEQ_LEN)),
    "recipe": ("--config", RECIPE),
}  # fmt: skip
RATIOS = (0.9, 0.8, 0.7)
# (method, stats file, option overrides); every one at every ratio, uniform ranks
METHODS = {
    "svd": (None, {}),
    "asvd": ("asvd", {}),
    "svd-llm": ("svd-llm", {}),
    "fwsvd": ("fwsvd", {}),
    "gfwsvd": ("gfwsvd-kfac", {}),
    "gfwsvd-nearest": ("gfwsvd-nearest", {"kronecker": "nearest"}),
}
GREEDY = {  # allocated ranks: every ratio for GFWSVD, 0.8 for the others
    "svd": (0.8,),
    "asvd": (0.8,),
    "svd-llm": (0.8,),
    "fwsvd": (0.8,),
    "gfwsvd": RATIOS,
    "gfwsvd-nearest": (0.8,),
}
STATS_JOBS = {"stats:activations": ("asvd", "svd-llm"), "stats:gradients": ("fwsvd", "gfwsvd")}
# Block by block on the compressed model (``methods.svd.sequential``), at 0.8 with greedy ranks:
# variant -> options. The dense statistics still allocate the ranks.
VARIANTS = {
    "refit": {"refit": "output"},
    "sequential": {"sequential": True},
    "sequential+refit": {"sequential": True, "refit": "output"},
    # then every factor pair trained on the dense model's logits (KL), one epoch of the windows
    "distill": {"distill_steps": NSAMPLES, "distill_lr": 1e-5},
    "distill lr 1e-4": {"distill_steps": NSAMPLES, "distill_lr": 1e-4},
    "distill lr 3e-4": {"distill_steps": NSAMPLES, "distill_lr": 3e-4},
    "distill 2 epochs lr 1e-4": {"distill_steps": 2 * NSAMPLES, "distill_lr": 1e-4},
    "distill 4 epochs lr 1e-4": {"distill_steps": 4 * NSAMPLES, "distill_lr": 1e-4},
    # the windows sampled from the dense model instead of wiki-calib (--calib self, LLM-QAT)
    "distill 2 epochs lr 1e-4 calib self": {
        "distill_steps": 2 * NSAMPLES,
        "distill_lr": 1e-4,
        "calib": "self",
    },  # fmt: skip
    # more distinct text instead of more epochs: the same steps as 4 epochs of 128 windows
    "distill 512 windows lr 1e-4": {
        "distill_steps": 4 * NSAMPLES,
        "distill_lr": 1e-4,
        "nsamples": 4 * NSAMPLES,
    },
}
# variant keys that change the job's text (RunOptions), not the method's options
JOB_KEYS = ("calib", "nsamples")


def variant_options(variant: str | None, job: bool) -> dict[str, Any]:
    """The options of ``variant`` (None: none) for the job's text (``job``) or the method."""
    return {k: v for k, v in VARIANTS.get(variant, {}).items() if (k in JOB_KEYS) == job}


VARIANT_ROWS = {
    "svd-llm": ("refit", "sequential", "sequential+refit"),
    "gfwsvd": tuple(VARIANTS),
}


def row_name(method: str, ratio: float, allocation: str, variant: str | None = None) -> str:
    return f"{method} {ratio:g} {allocation}" + (f" {variant}" if variant else "")


def _rows() -> list[dict[str, Any]]:
    rows = [{"name": "dense", "method": "dense"}]
    for ratio in RATIOS:
        for method in METHODS:
            rows.append({"method": method, "ratio": ratio, "allocation": "uniform"})
            if ratio in GREEDY[method]:
                rows.append({"method": method, "ratio": ratio, "allocation": "greedy"})
    for method, variants in VARIANT_ROWS.items():
        for variant in variants:
            rows.append({"method": method, "ratio": 0.8, "allocation": "greedy",
                         "variant": variant})  # fmt: skip
    for row in rows[1:]:
        row["name"] = row_name(row["method"], row["ratio"], row["allocation"], row.get("variant"))
    rows.append({"name": "combined", "method": "gfwsvd+sparsegpt", "ratio": 0.8})
    rows.append({"name": "sparsegpt 2:4", "method": "sparsegpt", "ratio": 0.5})
    for allocation in ("uniform", "greedy"):
        rows.append({"name": RESIDUAL.format(allocation), "method": "gfwsvd", "ratio": 0.3,
                     "allocation": allocation, "residual": "2:4"})  # fmt: skip
    rows += [{"name": name, "method": "gfwsvd", "ratio": 0.8} for name in END_TO_END]
    return rows


ROWS = _rows()
ORDER = [*STATS_JOBS, *(row["name"] for row in ROWS)]


def _stats_needed(row: dict[str, Any]) -> str | None:
    """The statistics job whose cached files the row reads (None: it reads none)."""
    method = "gfwsvd" if row["name"] == "combined" else row["method"]
    if row["name"] in ("dense", *END_TO_END) or method in ("svd", "sparsegpt"):
        return None
    return "stats:activations" if method in STATS_JOBS["stats:activations"] else "stats:gradients"


def _end_to_end_row(name: str, work: Path, eval_tokens: int) -> dict[str, Any]:
    """``compress-model`` with the ``END_TO_END`` flags of ``name``, the dense model not scored
    or copied, then ``compress-model eval --runtime packed`` of what it wrote."""
    out = work / "outputs" / ("gfwsvd-0.8" if name == "cli" else "gfwsvd80-distill")
    command = (
        *CLI, *END_TO_END[name], "--eval", *CORPORA, "--skip-dense", "--eval-tokens",
        str(eval_tokens), "--no-dense-copy", "--overwrite", "-o", str(out), "-q",
    )  # fmt: skip
    run = run_job(Job(name, command, out / "compression.json"), work)
    manifest = run.result
    reload_command = (*CLI, "eval", str(out), "--runtime", "packed", "--data", *CORPORA)
    reload_command += ("--eval-tokens", str(eval_tokens), "--json", "-q")
    reloaded = run_job(Job(f"{name} reload", reload_command, STDOUT), work)
    summary = manifest["report"]
    kept = sum(layer["params_kept"] for layer in summary["layers"])
    params = sum(layer["params"] for layer in summary["layers"])
    factorised = [layer for layer in summary["layers"] if layer.get("rank")]
    tensors = out / "compressed.safetensors"
    return {
        "name": name,
        "method": "gfwsvd",
        "ratio": 0.8,
        "command": " ".join(str(c) for c in command[2:]).replace(str(work), "WORK"),
        "wall_seconds": run.wall_seconds,
        "peak_rss_mb": run.peak_rss_mb,
        "params_kept_fraction": kept / params,
        "ppl": {c: manifest["results"]["compressed"][c]["perplexity"] for c in CORPORA},
        "reloaded_ppl": {c: reloaded.result["perplexity"][c]["perplexity"] for c in CORPORA},
        "reload_peak_rss_mb": reloaded.peak_rss_mb,
        "compressed_bytes": tensors.stat().st_size,
        # the fp32 factors; the header is the rest (a layer left dense is in model.safetensors)
        "expected_bytes": 4 * sum(layer["params_kept"] for layer in factorised),
    }


def run_row(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """A statistics job, the ``cli`` row, or a row factorised by ``benchmarks.child.lowrank``."""
    work, child = args.work, (PYTHON, "-m", "benchmarks.child.lowrank")
    if name in STATS_JOBS:
        run = run_job(Job(name, (*child, "stats", name, str(work / "stats")), STDOUT), work)
        return {"name": name, **run.result, **measured(run)}
    if name in END_TO_END:
        return _end_to_end_row(name, work, args.eval_tokens)
    spec = next(row for row in ROWS if row["name"] == name)
    command = (*child, "apply", json.dumps(spec), str(work / "stats"), str(args.eval_tokens))
    run = run_job(Job(name, command, STDOUT), work)
    return {**spec, **run.result, **measured(run)}


def measured(run: Run) -> dict[str, float]:
    return {"wall_seconds": run.wall_seconds, "peak_rss_mb": run.peak_rss_mb}


def record(args: argparse.Namespace, rows: list[dict]) -> dict[str, Any]:
    settings = {"checkpoint": CHECKPOINT, "nsamples": NSAMPLES, "seq_len": SEQ_LEN}
    return {**settings, "eval_tokens": args.eval_tokens, "results": rows}


def check_cached_stats(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A row rerun alone reads the statistics its job cached in ``--work``: they must be there."""
    for name in args.only:
        spec = next((row for row in ROWS if row["name"] == name), None)
        needed = None if spec is None else _stats_needed(spec)
        stats = args.work / "stats" if args.work else None
        if needed and needed not in args.only and not (stats and stats.is_dir()):
            parser.error(f"{name} needs {needed}'s cached statistics in --work DIR/stats")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_harness_args(parser, "rerun only these jobs (names as in the table)")
    parser.add_argument("--eval-tokens", type=int, default=16384)
    add_merge_arg(parser)
    args = parser.parse_args(argv)
    if args.merge and not args.render_only:
        merge_results(args.results_dir or RESULTS_DIR, args.merge, NAME, ORDER,
                      lambda _dir: {"results": []}, render, plot)  # fmt: skip
        return 0
    check_cached_stats(parser, args)
    return run_table(row_table(NAME, render, ORDER, run_row, record, plot=plot), args, parser)


if __name__ == "__main__":
    sys.exit(main())
