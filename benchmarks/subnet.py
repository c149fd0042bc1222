"""Stochastic subnetwork extraction (ASLP) on SmolLM2-135M at 50 % and 2:4, next to SparseGPT,
Wanda and MaskLLM at the same sparsity.

    python -m benchmarks.subnet --only NAME [NAME ...]   # run these configurations
    python -m benchmarks.subnet --render-only            # redraw md/png from the JSON

Each configuration runs as its own process (``benchmarks.runner``: wall time and peak RSS of
the whole ``compress-model`` process, evaluation included)::

    compress-model smollm2-135m --method METHOD --sparsity S --calib wiki-calib --nsamples 128
        --seq-len 512 --seed 0 --eval wiki-test lee --eval-tokens 32768 --skip-dense -o OUT -q
        <the configuration's args>

The one-shot baselines are not rerun: they are read from ``results/pruning.json`` (same
calibration, same scoring) and copied into ``subnet_smollm2.json`` when a configuration runs.
MaskLLM 2:4 is rerun here (its ``maskllm.json`` rows score wiki-test only), with the best block-wise
recipe of ``benchmarks.maskllm``. Results: ``results/subnet_smollm2.{json,md}`` and
``subnet_smollm2_curves.png``. Run configurations one or two at a time on the 2-core machine
(``OMP_NUM_THREADS=1`` each when two run side by side, each with its own ``--results-dir``,
then ``--merge DIR ...``); timings depend on the load.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import add_harness_args, add_merge_arg, merge_results, row_table, run_table
from benchmarks.render import RESULTS_DIR, dig, markdown_table, read_json
from benchmarks.runner import CLI, Job, machine, run_job
from benchmarks.subnet_configs import (
    ABLATION_BLOCKS,
    ABLATION_TOKENS,
    BASELINES,
    CONFIGS,
    SETTINGS,
)

NAME = "subnet_smollm2"
CORPORA = ("wiki-test", "lee")


def build_command(spec: dict[str, Any], out: Path) -> list[str]:
    s = SETTINGS
    sparsity = ["--sparsity", spec["sparsity"]] if spec.get("sparsity") else []
    return [
        *CLI, spec.get("checkpoint") or s["checkpoint"], "--method", spec["method"], *sparsity,
        "--calib", s["calib"], "--nsamples", str(s["nsamples"]), "--seq-len", str(s["seq_len"]),
        "--seed", str(s["seed"]), "--eval", *CORPORA, "--eval-tokens", str(s["eval_tokens"]),
        "--skip-dense", "-o", str(out), "-q", *spec["args"],
    ]  # fmt: skip


def run_config(name: str, args: argparse.Namespace) -> dict[str, Any]:
    spec, work = CONFIGS[name], args.work
    out = work / name
    shutil.rmtree(out, ignore_errors=True)
    cmd = build_command(spec, out)
    run = run_job(Job(name, cmd, reads=out / "compression.json"), work)
    manifest = run.result
    results, report = manifest.get("results", {}), manifest.get("report", {})
    extra = report.get("extra", {}) or {}
    layers = report.get("layers", []) or []
    kept = sum(layer.get("params_kept", 0) for layer in layers)
    total = sum(layer.get("params", 0) for layer in layers) or 1
    evals = [r for r in dig(results, "compressed") or {} if isinstance(r, str)]
    shutil.rmtree(out, ignore_errors=True)
    return {
        "name": name,
        "method": spec["method"],
        "sparsity": spec["sparsity"],
        "args": list(spec["args"]),
        "note": spec["note"],
        "ppl": {c: dig(results, "compressed", c, "perplexity") for c in CORPORA},
        "scored_tokens": {c: dig(results, "compressed", c, "tokens") for c in CORPORA},
        "eval_seconds": sum(dig(results, "compressed", c, "seconds") or 0.0 for c in evals),
        "wall_seconds": run.wall_seconds,
        "peak_rss_mb": run.peak_rss_mb,
        "train_seconds": report.get("seconds"),
        "steps": extra.get("steps"),
        "achieved_sparsity": 1.0 - kept / total,
        "hard_ppl": extra.get("hard_ppl", []),
        # block-wise: each block's hard-mask block error before and after training
        "block_hard": [
            {k: b.get(k) for k in ("block", "hard_before", "hard_after")}
            for b in extra.get("block_curves", []) or []
        ],
        "command": cmd[len(CLI) :],
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def load_baselines(results_dir: Path) -> list[dict[str, Any]]:
    pruning = read_json(results_dir / "pruning.json", {})
    rows = []
    for method, sparsity in BASELINES:
        found = next(
            (
                r
                for r in pruning.get("results", [])
                if r.get("method") == method
                and r.get("sparsity") == sparsity
                and r.get("tool") == "lmcompress"
            ),
            None,
        )
        if found is None:
            continue
        rows.append(
            {
                "name": f"{method} {sparsity}",
                "method": method,
                "sparsity": sparsity,
                "ppl": {c: dig(found, "ppl", c, "perplexity") for c in CORPORA},
                "wall_seconds": found.get("wall_seconds"),
                "peak_rss_mb": found.get("peak_rss_mb"),
                "source": "pruning.json",
            }
        )
    dense = next((r for r in pruning.get("results", []) if r.get("method") == "dense"), None)
    if dense is not None:
        rows.insert(0, {"name": "dense", "method": "dense", "sparsity": "-", "source":
                        "pruning.json", "ppl": {c: dig(dense, "ppl", c, "perplexity")
                                                for c in CORPORA}})  # fmt: skip
    return rows


def _num(value: Any, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def render(payload: dict[str, Any]) -> str:
    s = payload["settings"]
    lines = [
        "# Subnetwork extraction on SmolLM2-135M (`python -m benchmarks.subnet`)\n",
        f"Every linear in the decoder blocks; {s['nsamples']} × {s['seq_len']} tokens of "
        f"{s['calib']} (seed {s['seed']}), 2 of them held out for the hard-mask ppl; "
        f"perplexity at seq-len {s['seq_len']} over the first {s['eval_tokens']} tokens of "
        "wiki-test and lee. `÷ SparseGPT`: wiki-test ppl over SparseGPT's at the same sparsity "
        "as rerun here (one thread, like the learned rows), else as in `pruning.json`. "
        "One-shot rows: `results/pruning.json` (wall / RSS of compression "
        "without evaluation). Learned rows: wall / peak RSS of the whole `compress-model` "
        "process, evaluation included (`eval s`); `train s` is the method's own time (prior, "
        "training, extraction). Sparsity: achieved over the selected layers.\n",
    ]
    header = ["config", "sparsity", "achieved", "wiki-test ppl", "lee ppl", "÷ SparseGPT",
              "wall s", "eval s", "train s", "peak RSS MiB", "source"]  # fmt: skip
    baselines = {r["name"]: r for r in payload["baselines"]}
    table = []
    main_rows = [r for r in payload["results"] if not CONFIGS.get(r["name"], {}).get("ablation")]
    ablations = [r for r in payload["results"] if CONFIGS.get(r["name"], {}).get("ablation")]
    rerun = {r["sparsity"]: r for r in main_rows if r["method"] == "sparsegpt"}
    for row in [*payload["baselines"], *main_rows]:
        # the reference: SparseGPT rerun here under the same conditions, if it was
        ref = rerun.get(row["sparsity"]) or baselines.get(f"sparsegpt {row['sparsity']}")
        ratio = (
            row["ppl"]["wiki-test"] / ref["ppl"]["wiki-test"]
            if ref and row["ppl"].get("wiki-test") and row["method"] != "dense"
            else None
        )
        table.append([
            row["name"], row["sparsity"], _num(row.get("achieved_sparsity"), 4),
            _num(row["ppl"].get("wiki-test")), _num(row["ppl"].get("lee")), _num(ratio, 3),
            _num(row.get("wall_seconds"), 0), _num(row.get("eval_seconds"), 0),
            _num(row.get("train_seconds"), 0), _num(row.get("peak_rss_mb"), 0),
            row.get("source", "this script"),
        ])  # fmt: skip
    lines.append(markdown_table(header, table))
    if ablations:
        lines.append(
            f"\nAblations (50 % unless named): blocks 0-{ABLATION_BLOCKS - 1} only (the "
            f"others dense), 20 steps per block, perplexity over the first {ABLATION_TOKENS} "
            "tokens; block "
            "error: the hard (extracted) masks' relative block-output error on two captured "
            "batches, mean over the blocks, before training (the SparseGPT prior's mask, scale "
            "1) and after; `after ÷ before`: the mean of the blocks' ratios.\n"
        )
        header = ["ablation", "block error before", "after", "after ÷ before", "wiki-test ppl",
                  "lee ppl", "train s"]  # fmt: skip
        table = []
        for row in ablations:
            hard = [b for b in row.get("block_hard", []) if b.get("hard_after") is not None]
            before = sum(b["hard_before"] for b in hard) / len(hard) if hard else None
            after = sum(b["hard_after"] for b in hard) / len(hard) if hard else None
            table.append([
                row["name"].removeprefix("ablation: "), _num(before, 4), _num(after, 4),
                _num(sum(b["hard_after"] / b["hard_before"] for b in hard) / len(hard)
                     if hard else None, 3), _num(row["ppl"].get("wiki-test")),
                _num(row["ppl"].get("lee")), _num(row.get("train_seconds"), 0),
            ])  # fmt: skip
        lines.append(markdown_table(header, table))
    lines.append("")
    for row in main_rows:
        args = " ".join(row["args"])
        lines.append(f"- **{row['name']}**: {row['note']} (`{args}`) [run {row['finished']}]")
    if payload.get("note"):
        lines += ["", payload["note"]]
    return "\n".join(lines) + "\n"


def plot(payload: dict[str, Any], results_dir: Path, path: Path) -> None:  # noqa: ARG001
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [*payload["baselines"], *payload["results"]]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, sparsity in zip(axes, ("0.5", "2:4"), strict=True):
        chosen = [
            r
            for r in rows
            if r["sparsity"] == sparsity
            and r["ppl"].get("wiki-test")
            and not CONFIGS.get(r["name"], {}).get("ablation")
        ]
        x = range(len(chosen))
        for offset, corpus in ((-0.2, "wiki-test"), (0.2, "lee")):
            ax.bar([i + offset for i in x], [r["ppl"][corpus] or 0 for r in chosen], 0.4,
                   label=corpus)  # fmt: skip
        ax.set_xticks(list(x), [r["name"] for r in chosen], rotation=35, ha="right", fontsize=7)
        ax.set_ylabel("perplexity")
        ax.set_title(f"sparsity {sparsity}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def record(args: argparse.Namespace, rows: list[dict]) -> dict[str, Any]:
    """Around the rows: the settings and the one-shot baselines, as ``pruning.json`` has them."""
    return {"settings": SETTINGS, "baselines": load_baselines(args.results_dir), "results": rows}


def empty_record(results_dir: Path) -> dict[str, Any]:
    """The record a ``--merge`` starts from when there is no results file yet."""
    return {"settings": SETTINGS, "machine": machine(), "baselines": load_baselines(results_dir),
            "results": []}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_harness_args(parser, "run only these configurations")
    add_merge_arg(parser)
    args = parser.parse_args(argv)
    if args.merge and not args.render_only:
        merge_results(args.results_dir or RESULTS_DIR, args.merge, NAME, list(CONFIGS),
                      empty_record, render, plot)  # fmt: skip
        return 0
    table = row_table(NAME, render, list(CONFIGS), run_config, record, plot=plot)
    return run_table(table, args, parser)


if __name__ == "__main__":
    sys.exit(main())
