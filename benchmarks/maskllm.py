"""Learned 2:4 masks (MaskLLM) on SmolLM2-135M, next to the one-shot 2:4 baselines.

    python -m benchmarks.maskllm --only paper [NAME ...]   # run these configurations
    python -m benchmarks.maskllm --list                    # the configurations and their args
    python -m benchmarks.maskllm --render-only             # redraw md/png from the JSON

Every configuration in ``CONFIGS`` is a name, the extra ``compress-model`` flags it adds, and a
note. Each one runs as its own process::

    compress-model CHECKPOINT --method maskllm --sparsity 2:4 --calib wiki-calib --nsamples N
        --seq-len 512 --seed 0 --eval wiki-test --eval-tokens 32768 --skip-dense -o OUT -q
        <the configuration's args>

as one job of ``benchmarks.runner`` (wall time and peak RSS of the process; its stdout and
stderr go to ``WORK/NAME.{out,log}``; ``--configs`` is another name for ``--only``). A
configuration's args come last, so they override a common flag they repeat (e.g. ``--nsamples
512``). Then ``OUT/compression.json`` is read, the output directory deleted (``--keep`` keeps
it), and the configuration's row replaces its old one in ``benchmarks/results/maskllm.json``
(rows of configurations not run are kept), its curves replace its old entry in
``maskllm_curves.json``, and ``maskllm.md`` and ``maskllm_curves.png`` are redrawn from the two
files. A failed configuration is logged and
skipped (its work directory and log are kept); the exit status is then 1.

What the numbers mean:

- **wiki-test ppl**: perplexity of the exported model (argmax masks) on the first
  ``--eval-tokens`` tokens of wiki-test at seq-len 512 — the same scoring as the baselines.
- **÷ SparseGPT 2:4**: that ppl divided by our SparseGPT 2:4 ppl in ``results/pruning.json``
  (below 1 = the learned mask beats the one-shot one; the goal line is 0.9).
- **wall s**, **peak RSS MiB**: of the whole ``compress-model`` process (the runner): load,
  the one-shot prior (SparseGPT by default), training, the wiki-test evaluation of the
  compressed model (**eval s**, so ``wall - eval`` is comparable with the baselines' wall, which
  excludes evaluation), and the save. **train s**: the method's own ``report.seconds`` (prior +
  training + applying the masks).
- **train tokens**: tokens the mask logits were trained on, ``report.extra.tokens`` if the method
  reports it, else ``steps × batch_size × grad_accum × seq_len`` (steps from
  ``report.extra.steps``, the others from ``report.config`` / ``results.options``). The prior's
  calibration pass ((nsamples − eval_windows) × seq_len tokens) is not counted.
- **hard ppl**: the method's own hard-mask perplexity on ``--eval-windows`` held-out calibration
  windows (wiki-calib, not wiki-test), at step 0 (the prior's mask) and every ``--eval-every``
  steps; in the left panel of the PNG, next to the SparseGPT 2:4 wiki-test line (a guide, not the
  same text).

The baselines (dense, magnitude / Wanda / SparseGPT 2:4) are not rerun: they are read from
``results/pruning.json`` (``benchmarks/pruning.py``; magnitude and dense fall back to
``results/magnitude.json``), marked so in the table, and stored in ``maskllm.json`` when a
configuration runs (``--render-only`` draws from the stored copy and reads no other file).

Timings are sensitive to anything else running on the 2-core machine: run one benchmark at a
time on an otherwise idle machine and compare wall times only between runs made that way.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import maskllm_plot
from benchmarks.harness import add_harness_args, row_table, run_table
from benchmarks.maskllm_results import (
    load_baselines,
    parse_manifest,
    ratio,
    reference_ppl,
    render,
    rounded,
)
from benchmarks.render import read_json, write_json
from benchmarks.runner import CLI, Job, run_job

NAME = "maskllm"
plot = maskllm_plot.plot  # NAME_curves.png from NAME.json + maskllm_curves.json

# name -> {"args": extra compress-model flags, "note": what it tests}. Edit freely: any flag the
# CLI accepts may appear; --steps / --lr / ... belong here, not in the common args.
# fmt: off
# Block-wise learning + SparseGPT re-fit; each configuration adds its --steps (per block).
BLOCKWISE_REFIT = [
    "--batch-size", "4", "--lr", "1e-3", "--tau", "4", "0.05", "--kappa", "100", "500",
    "--prior", "sparsegpt", "--prior-strength", "3", "--weight-reg", "1e-5",
    "--blockwise", "--refit", "sparsegpt", "--eval-windows", "2",
]
PAPER = [
    "--steps", "100", "--batch-size", "1", "--grad-accum", "1", "--lr", "2e-4",
    "--tau", "4", "0.05", "--kappa", "100", "500",
    "--prior", "sparsegpt", "--prior-strength", "3",
    "--weight-reg", "1e-5", "--no-weight-reg-norm", "--no-distill",
    "--eval-every", "20", "--eval-windows", "2",
]
CONFIGS: dict[str, dict[str, Any]] = {
    "paper": {
        "args": PAPER,
        "note": "paper-faithful recipe (end to end, exact Gumbel noise, SparseGPT prior without "
                "weight update, alpha 3, tau 4->0.05, kappa 100->500, lambda 1e-5 un-normalised, "
                "AdamW 0.9/0.95 wd 0.1, cosine lr, clip 1.0); 100 steps of one 512-token window "
                "(~15 s a step here) to fit the session, not the paper's ~2e9 tokens; lr 2e-4 "
                "(2e-3 diverged in the prototype)",
    },
    "paper-pool": {
        "args": [*PAPER, "--noise", "pool"],
        "note": "paper with pooled Gumbel noise (windows of one pre-drawn pool instead of fresh "
                "exact noise for all 159M logits, twice a step): what the cheaper sampling buys",
    },
    "blockwise-refit": {
        "args": ["--steps", "40", *BLOCKWISE_REFIT],
        "note": "beyond the paper: masks learned block by block (40 steps of 4 windows per "
                "block) to match the dense model's block outputs, prior from SparseGPT on the "
                "compressed inputs, then the kept weights re-fitted with SparseGPT's OBS "
                "updates under the learned mask; the un-normalised lambda 1e-5 term is ~1e-5 of "
                "the block loss here, i.e. effectively off",
    },
    "blockwise-refit-20": {
        "args": ["--steps", "20", *BLOCKWISE_REFIT],
        "note": "blockwise-refit with half the steps per block (a second point of the "
                "ppl-vs-steps curve)",
    },
    "blockwise-refit-20-st": {
        "args": ["--steps", "20", *BLOCKWISE_REFIT, "--straight-through-from", "0.8"],
        "note": "blockwise-refit-20 with straight-through hard samples in the last 20 % of each "
                "block's steps (forward the sampled exact 2:4 pattern, backward the soft mask's "
                "gradient)",
    },
}
# fmt: on


# --- one run ------------------------------------------------------------------------------


def build_command(args: list[str], out: Path, settings: dict[str, Any]) -> list[str]:
    """The ``compress-model`` command of one configuration (its args last, so they win)."""
    return [
        *CLI,
        settings["checkpoint"],
        "--method",
        "maskllm",
        "--sparsity",
        settings["sparsity"],
        "--calib",
        settings["calib"],
        "--nsamples",
        str(settings["nsamples"]),
        "--seq-len",
        str(settings["seq_len"]),
        "--seed",
        str(settings["seed"]),
        "--eval",
        settings["eval"],
        "--eval-tokens",
        str(settings["eval_tokens"]),
        "--skip-dense",
        "-o",
        str(out),
        "-q",
        *args,
    ]


def run_config(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run one configuration; its row. Its curves replace its entry in ``maskllm_curves.json``
    (drawn with the table's PNG)."""
    spec, settings, work = CONFIGS[name], settings_of(args), args.work
    keep = Path(args.keep) if args.keep else None
    out = (keep or work) / name
    shutil.rmtree(out, ignore_errors=True)
    cmd = build_command(list(spec["args"]), out, settings)
    run = run_job(Job(name, cmd, reads=out / "compression.json"), work)
    row, curve = parse_manifest(run.result, settings["eval"])
    row = {
        "name": name,
        "args": list(spec["args"]),
        "note": spec.get("note", ""),
        "wall_seconds": run.wall_seconds,
        "peak_rss_mb": run.peak_rss_mb,
        **row,
        "settings": dict(settings),
        "command": cmd[len(CLI) :],
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    if keep is None:
        shutil.rmtree(out, ignore_errors=True)
    curves = args.results_dir / maskllm_plot.CURVES
    write_json(curves, {**read_json(curves, {}), name: curve}, indent=1)
    return row


# --- results files ------------------------------------------------------------------------


def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    keys = ("checkpoint", "sparsity", "calib", "eval", "nsamples", "seq_len", "seed")
    return {**{k: getattr(args, k) for k in keys}, "eval_tokens": args.eval_tokens}


def record(args: argparse.Namespace, rows: list[dict]) -> dict[str, Any]:
    """maskllm.json: the rows, each with its ratio to SparseGPT 2:4, and the baselines as they
    are now in ``pruning.json`` / ``magnitude.json``."""
    baselines = load_baselines(args.results_dir, args.eval)
    ref = reference_ppl(baselines)
    for r in rows:
        r["ratio_to_sparsegpt"] = rounded(ratio(r.get("ppl"), ref), 4)
    return {"settings": settings_of(args), "baselines": baselines, "results": rows}


# --- main ---------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print the configurations and exit")
    parser.add_argument("--checkpoint", default="smollm2-135m")
    parser.add_argument("--sparsity", default="2:4")
    parser.add_argument("--calib", default="wiki-calib")
    parser.add_argument("--eval", default="wiki-test", help="the one corpus scored")
    parser.add_argument("--nsamples", type=int, default=128, help="calibration/training windows")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-tokens", type=int, default=32768)
    parser.add_argument("--keep", help="keep each output directory as KEEP/NAME")
    add_harness_args(parser, f"the configurations to run, of {', '.join(CONFIGS)}")
    parser.add_argument("--configs", nargs="+", dest="only", help="the same as --only")
    args = parser.parse_args(argv)
    if args.list:
        for name, spec in CONFIGS.items():
            print(f"{name}: {' '.join(spec['args'])}\n    {spec.get('note', '')}")
        return 0
    if not args.only and not args.render_only:
        parser.error("give --only NAME [NAME ...] (or --list / --render-only)")
    table = row_table(NAME, render, list(CONFIGS), run_config, record, plot=plot)
    return run_table(table, args, parser)


if __name__ == "__main__":
    sys.exit(main())
