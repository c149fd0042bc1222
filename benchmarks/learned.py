"""Learned masks on SmolLM2-135M against SparseGPT measured here: what each recipe buys on both
corpora, for how many training tokens, at what speed and memory.

    python -m benchmarks.learned --only sparsegpt-24 maskllm-blockwise   # run these recipes
    python -m benchmarks.learned --render-only                           # redraw md/png

Each recipe (``benchmarks.learned_configs.CONFIGS``) is one or more ``compress-model`` stages,
each its own process (``benchmarks.runner``: wall time and peak RSS)::

    compress-model smollm2-135m --method METHOD --sparsity S --calib wiki-calib --nsamples 128
        --seq-len 512 --seed 0 --eval wiki-test lee --eval-tokens 32768 --skip-dense -o OUT -q
        <the stage's args>

A later stage reads an earlier one's output (``{stage1}`` in its args: e.g. ``--prior-from``).
Stage outputs stay in ``WORK/stages/<digest of the command>``: a recipe whose stage has the same
command as one run before in the same ``--work`` reuses that run (its output and measurements).
A row sums the stages' wall, train seconds and training tokens, takes the largest peak RSS, and
scores the last stage's model. ``÷ SparseGPT`` divides each corpus's perplexity by the SparseGPT
row of the same sparsity *in this file* (the same machine and thread count: run the baseline
with the learned rows); a row measured under another thread count than its baseline is flagged.

- **tokens**: tokens the learned parameters were trained on: ``steps × batch × accum × seq_len``
  per stage (block-wise: the windows that pass through each block, counted once; the prior's
  calibration pass not counted). **tokens/s**: tokens over the stages' training seconds.
- **hard ppl**: the method's own perplexity on the held-out calibration windows during training,
  drawn against the training tokens in the PNG (left); the right panel: wiki-test and lee
  perplexity of each recipe against its tokens.

Run recipes one or two at a time on the 2-core machine (``OMP_NUM_THREADS=1`` each when two run
side by side, each with its own ``--results-dir``, then ``--merge DIR ...``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import add_harness_args, add_merge_arg, merge_results, row_table, run_table
from benchmarks.learned_configs import CONFIGS
from benchmarks.render import RESULTS_DIR, dig, markdown_table
from benchmarks.runner import CLI, Job, machine, run_job
from benchmarks.subnet import CORPORA, build_command  # the same SmolLM2 job, other flags
from benchmarks.subnet_configs import SETTINGS

NAME = "learned"
log = logging.getLogger(__name__)


def stage_tokens(manifest: dict[str, Any]) -> int:
    """Training tokens of one stage (0 for a one-shot method)."""
    report = manifest.get("report", {}) or {}
    extra, config = report.get("extra", {}) or {}, report.get("config", {}) or {}
    if extra.get("tokens") is not None:
        return int(extra["tokens"])
    training = config.get("training", config)
    steps = extra.get("steps") or 0
    batch = training.get("batch_size", 1) * training.get("grad_accum", 1)
    return int(steps * batch * SETTINGS["seq_len"])


def run_stage(name: str, cmd: list[str], out: Path, work: Path) -> dict[str, Any]:
    """One stage's process, or its stored run: a stage run before with the same command (the
    same recipe prefix, e.g. the block-wise pass two recipes start from) is reused, its
    measurements too (``reused``), from ``WORK/stages/<digest>``."""
    key = hashlib.sha1(json.dumps(cmd[len(CLI) :]).encode()).hexdigest()[:12]
    stored = work / "stages" / key
    if (stored / "stage.json").is_file():
        log.info("%s: reusing the stage run in %s", name, stored)
        return {**json.loads((stored / "stage.json").read_text()), "out": str(stored / "out"),
                "reused": True}  # fmt: skip
    shutil.rmtree(out, ignore_errors=True)
    run = run_job(Job(name, cmd, reads=out / "compression.json"), work)
    stored.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(stored / "out", ignore_errors=True)
    shutil.move(out, stored / "out")
    record = {"wall_seconds": run.wall_seconds, "peak_rss_mb": run.peak_rss_mb,
              "manifest": run.result}  # fmt: skip
    (stored / "stage.json").write_text(json.dumps(record))
    return {**record, "out": str(stored / "out"), "reused": False}


def run_config(name: str, args: argparse.Namespace) -> dict[str, Any]:
    spec, work = CONFIGS[name], args.work
    outs, stages, commands = {}, [], []
    for index, stage in enumerate(spec["stages"], start=1):
        stage_args = [a.format(**outs) for a in stage["args"]]
        stage_spec = {
            "method": stage["method"],
            "sparsity": stage.get("sparsity", spec["sparsity"]),  # None: a stage without one
            "checkpoint": stage.get("checkpoint", "").format(**outs),  # "": the dense model
            "args": stage_args,
        }
        cmd = build_command(stage_spec, work / "out")
        run = run_stage(f"{name}.stage{index}", cmd, work / "out", work)
        outs[f"stage{index}"] = run["out"]
        manifest = run["manifest"]
        report = manifest.get("report", {}) or {}
        stages.append({
            "method": stage["method"], "wall_seconds": run["wall_seconds"],
            "peak_rss_mb": run["peak_rss_mb"], "train_seconds": report.get("seconds"),
            "tokens": stage_tokens(manifest), "steps": (report.get("extra") or {}).get("steps"),
            "hard_ppl": (report.get("extra") or {}).get("hard_ppl", []),
            "ppl": {c: dig(manifest, "results", "compressed", c, "perplexity") for c in CORPORA},
            "reused": run["reused"],
        })  # fmt: skip
        commands.append(cmd[len(CLI) :])
        last = manifest
    results = last.get("results", {})
    evals = [c for c in CORPORA if dig(results, "compressed", c)]
    train_s = sum(s["train_seconds"] or 0.0 for s in stages)
    tokens = sum(s["tokens"] for s in stages)
    return {
        "name": name,
        "sparsity": spec["sparsity"],
        "baseline": spec.get("baseline"),
        "stages": stages,
        "note": spec["note"],
        "ppl": {c: dig(results, "compressed", c, "perplexity") for c in CORPORA},
        "eval_seconds": sum(dig(results, "compressed", c, "seconds") or 0.0 for c in evals),
        "wall_seconds": sum(s["wall_seconds"] for s in stages),
        "peak_rss_mb": max((s["peak_rss_mb"] or 0.0 for s in stages), default=None),
        "train_seconds": train_s,
        "tokens": tokens,
        "tokens_per_second": tokens / train_s if tokens and train_s else None,
        "threads": os.environ.get("OMP_NUM_THREADS"),
        "commands": commands,
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def _num(value: Any, digits: int = 2) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def baseline_of(rows: list[dict[str, Any]], row: dict[str, Any]) -> dict[str, Any] | None:
    """The row ``row`` is divided by: the one its recipe names (``baseline``: e.g. SparseGPT
    then int8 for the int8 rows), else the first SparseGPT row of its sparsity."""
    if row.get("baseline"):
        return next((r for r in rows if r["name"] == row["baseline"]), None)
    return next((r for r in rows if r["name"].startswith("sparsegpt") and
                 r["sparsity"] == row["sparsity"] and not r.get("baseline")), None)  # fmt: skip


def render(payload: dict[str, Any]) -> str:
    s, host = payload["settings"], payload.get("machine", {})
    rows = payload["results"]
    lines = [
        "# Learned masks on SmolLM2-135M (`python -m benchmarks.learned`)\n",
        f"Every linear in the decoder blocks; {s['nsamples']} × {s['seq_len']} tokens of "
        f"{s['calib']} (seed {s['seed']}) to learn from (2 held out); perplexity at seq-len "
        f"{s['seq_len']} over the first {s['eval_tokens']} tokens of wiki-test and lee. "
        "`÷ SparseGPT`: each corpus's perplexity over the SparseGPT row of the same sparsity "
        "in this table (same machine, same thread count); a row divided by another row says "
        "which (the int8 rows: by SparseGPT then int8). Wall and peak RSS: the whole "
        "`compress-model` processes (all stages, evaluation included); train s: the methods' "
        "own time (prior, training, re-fit); tokens: training tokens (block-wise: the windows "
        "through each block, once); tokens/s: tokens over train s. The PNG: the held-out "
        "hard-mask perplexity during training against the tokens (a line a stage: the last "
        "point of a stage with `--refit` is after the re-fit), and each recipe's final "
        "perplexities.\n",
        f"Machine: {host.get('cpu_model', '?')} ({host.get('cpu_count', '?')} cores; "
        f"{', '.join(host.get('isa', []) or ['no AVX-512 VNNI/BF16 or AMX'])}); torch "
        f"{host.get('torch', '?')}; threads: the row's `OMP_NUM_THREADS`.\n",
    ]
    header = [
        "recipe",
        "sparsity",
        "wiki-test ppl",
        "lee ppl",
        "÷ SparseGPT (wiki / lee)",
        "tokens",
        "tokens/s",
        "train s",
        "wall s",
        "eval s",
        "peak RSS MiB",
        "threads",
    ]
    table = []
    for row in rows:
        ref = baseline_of(rows, row)
        ratios = "-"
        if ref and ref is not row and all(row["ppl"].get(c) for c in CORPORA):
            ratios = " / ".join(f"{row['ppl'][c] / ref['ppl'][c]:.3f}" for c in CORPORA)
            if row.get("baseline"):
                ratios += f" (÷ {ref['name']})"
            if ref.get("threads") != row.get("threads"):
                ratios += " (other threads)"
        table.append([
            row["name"], row["sparsity"], _num(row["ppl"].get("wiki-test")),
            _num(row["ppl"].get("lee")), ratios, f"{row.get('tokens') or 0:,}",
            _num(row.get("tokens_per_second"), 1), _num(row.get("train_seconds"), 0),
            _num(row.get("wall_seconds"), 0), _num(row.get("eval_seconds"), 0),
            _num(row.get("peak_rss_mb"), 0), row.get("threads") or "all",
        ])  # fmt: skip
        # earlier stages scored: divided by the plain SparseGPT row (an int8 row's stage 1 is
        # still float)
        ref = baseline_of(rows, {**row, "baseline": None})
        for index, stage in enumerate(row["stages"][:-1], start=1):
            if all(stage.get("ppl", {}).get(c) for c in CORPORA) and ref:
                table.append([
                    f"{row['name']} (stage {index})", row["sparsity"],
                    *(_num(stage["ppl"][c]) for c in CORPORA),
                    " / ".join(f"{stage['ppl'][c] / ref['ppl'][c]:.3f}" for c in CORPORA),
                    f"{stage['tokens']:,}", _num(stage["tokens"] / stage["train_seconds"]
                                                 if stage.get("train_seconds") and
                                                 stage["tokens"] else None, 1),
                    _num(stage.get("train_seconds"), 0), _num(stage["wall_seconds"], 0), "-",
                    _num(stage["peak_rss_mb"], 0), row.get("threads") or "all",
                ])  # fmt: skip
    lines.append(markdown_table(header, table))
    lines.append("")
    for row in rows:
        reused = [str(i) for i, st in enumerate(row["stages"], 1) if st.get("reused")]
        again = f"; stage {', '.join(reused)} reused from an identical run" if reused else ""
        lines.append(f"- **{row['name']}**: {row['note']} [run {row['finished']}{again}]")
        for cmd in row["commands"]:
            lines.append(f"  - `compress-model {' '.join(cmd)}`")
    return "\n".join(lines) + "\n"


def plot(payload: dict[str, Any], results_dir: Path, path: Path) -> None:  # noqa: ARG001
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = payload["results"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for index, row in enumerate(rows):
        done, color = 0, f"C{index % 10}"
        for number, stage in enumerate(row["stages"]):  # one line a stage: weights change
            per_step = stage["tokens"] / stage["steps"] if stage.get("steps") else 0
            hard = [p for p in stage.get("hard_ppl", []) if p.get("hard_ppl") is not None]
            if hard:
                xs = [done + p.get("step", 0) * per_step for p in hard]
                left.plot(xs, [p["hard_ppl"] for p in hard], marker="o", color=color,
                          label=row["name"] if number == 0 else None)  # fmt: skip
            done += stage["tokens"]
    left.set_xlabel("training tokens")
    left.set_ylabel("hard-mask ppl (held-out wiki-calib)")
    left.set_yscale("log")
    left.legend(fontsize=7)
    for corpus, marker in (("wiki-test", "o"), ("lee", "s")):
        for row in rows:
            if row["ppl"].get(corpus):
                right.scatter(row.get("tokens") or 0, row["ppl"][corpus], marker=marker)
                right.annotate(f"{row['name']} ({corpus})", (row.get("tokens") or 0,
                               row["ppl"][corpus]), fontsize=6)  # fmt: skip
    right.set_xlabel("training tokens")
    right.set_ylabel("perplexity (o wiki-test, s lee)")
    right.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def record(args: argparse.Namespace, rows: list[dict]) -> dict[str, Any]:  # noqa: ARG001
    return {"settings": SETTINGS, "results": rows}


def empty_record(_results_dir: Path) -> dict[str, Any]:
    """The record a ``--merge`` starts from when there is no results file yet."""
    return {"settings": SETTINGS, "machine": machine(), "results": []}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_harness_args(parser, "run only these recipes")
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
