"""Learned 2:4 masks (MaskLLM) on SmolLM2-135M, next to the one-shot 2:4 baselines.

    python benchmarks/maskllm.py --configs paper [NAME ...]   # run these configurations
    python benchmarks/maskllm.py --list                      # the configurations and their args
    python benchmarks/maskllm.py --render-only               # redraw md/png from the JSON

Every configuration in ``CONFIGS`` is a name, the extra ``compress-model`` flags it adds, and a
note. Each one runs as its own process::

    compress-model CHECKPOINT --method maskllm --sparsity 2:4 --calib wiki-calib --nsamples N
        --seq-len 512 --seed 0 --eval wiki-test --eval-tokens 32768 --skip-dense -o OUT -q
        <the configuration's args>

under ``/usr/bin/time -v`` (its log goes to ``WORK/NAME.log``). A configuration's args come last,
so they override a common flag they repeat (e.g. ``--nsamples 512``). Then ``OUT/compression.json``
is read, the output directory deleted (``--keep`` keeps it), and the configuration's row replaces
its old one in ``benchmarks/results/maskllm.json`` (rows of configurations not run are kept), its
curves replace its old entry in ``maskllm_curves.json``, and ``maskllm.md`` and
``maskllm_curves.png`` are redrawn from the two files. A failed configuration is logged and
skipped (its work directory and log are kept); the exit status is then 1.

What the numbers mean:

- **wiki-test ppl**: perplexity of the exported model (argmax masks) on the first
  ``--eval-tokens`` tokens of wiki-test at seq-len 512 — the same scoring as the baselines.
- **÷ SparseGPT 2:4**: that ppl divided by our SparseGPT 2:4 ppl in ``results/pruning.json``
  (below 1 = the learned mask beats the one-shot one; the goal line is 0.9).
- **wall s**, **peak RSS MB**: of the whole ``compress-model`` process (GNU ``time -v``): load,
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
``results/magnitude.json``) and marked so in the table.

Timings are sensitive to anything else running on the 2-core machine: run one benchmark at a
time on an otherwise idle machine and compare wall times only between runs made that way.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "peers"))
from common import ROOT, markdown_table  # noqa: E402

log = logging.getLogger("maskllm")

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

# (row name, method, sparsity) of the baseline rows, read from pruning.json (tool lmcompress).
BASELINES = [
    ("dense", "dense", "-"),
    ("magnitude 2:4", "magnitude", "2:4"),
    ("Wanda 2:4", "wanda", "2:4"),
    ("SparseGPT 2:4", "sparsegpt", "2:4"),
]
REFERENCE = "SparseGPT 2:4"
GOAL = 0.9  # the target ratio to SparseGPT 2:4
CURVE_KEYS = ("loss_curve", "hard_ppl", "steps", "tokens")
CLI = [sys.executable, "-m", "lmcompress.cli.main"]


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


def timed_run(cmd: list[str], log_path: Path) -> tuple[float, float]:
    """Run ``cmd`` under GNU ``time -v`` with its output in ``log_path``: (wall s, peak RSS MiB).

    Like ``pruning.timed`` but the job's output goes to a file, not memory: an hour-long run that
    fails keeps its whole log."""
    from run_peer import parse_time_v  # imports torch: only when something runs

    time_path = log_path.with_suffix(".time")
    with log_path.open("w") as out:
        proc = subprocess.run(
            ["/usr/bin/time", "-v", "-o", str(time_path), *cmd],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env={**os.environ, "TQDM_DISABLE": "1"},
        )
    if proc.returncode != 0:
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"exit {proc.returncode}: {' '.join(cmd)}\n{tail}")
    return parse_time_v(time_path.read_text())


def _get(tree: Any, *path: str, default: Any = None) -> Any:
    for key in path:
        if not isinstance(tree, dict) or key not in tree:
            return default
        tree = tree[key]
    return tree


def tokens_used(manifest: dict[str, Any]) -> tuple[int | None, str]:
    """(training tokens, how they were counted) from a ``compression.json``."""
    extra = _get(manifest, "report", "extra", default={}) or {}
    if isinstance(extra.get("tokens"), (int, float)):
        return int(extra["tokens"]), "report.extra.tokens"
    config = _get(manifest, "report", "config", default={}) or {}
    steps = extra.get("steps")
    if steps is None and isinstance(extra.get("loss_curve"), list):
        steps = len(extra["loss_curve"])
    if steps is None:
        steps = config.get("steps")
    seq_len = _get(manifest, "results", "options", "seq_len")
    factors = (steps, config.get("batch_size", 1), config.get("grad_accum", 1), seq_len)
    if any(not isinstance(f, (int, float)) for f in factors):
        return None, "unknown"
    formula = "steps × batch_size × grad_accum × seq_len"
    blocks = extra.get("block_curves")
    if isinstance(blocks, list) and blocks:  # block-wise: --steps per block, same windows
        formula += f" (per block; {len(blocks)} blocks each train on these windows)"
    return math.prod(int(f) for f in factors), formula


def parse_manifest(manifest: dict[str, Any], corpus: str = "wiki-test") -> tuple[dict, dict]:
    """(row fields, curves) of one run from its ``compression.json``; missing keys -> None."""
    results = manifest.get("results", {}) or {}
    report = manifest.get("report", {}) or {}
    extra = report.get("extra", {}) or {}
    config = report.get("config", {}) or {}
    compressed = results.get("compressed", {}) or {}
    loss = [h for h in extra.get("loss_curve", []) or [] if isinstance(h, dict)]
    hard = [h for h in extra.get("hard_ppl", []) or [] if isinstance(h, dict) and "hard_ppl" in h]
    tokens, formula = tokens_used(manifest)
    row = {
        "ppl": _get(compressed, corpus, "perplexity"),
        "corpus": corpus,
        "scored_tokens": _get(compressed, corpus, "tokens"),
        "eval_seconds": _round(
            sum(r.get("seconds", 0.0) for d in ("compressed", "dense") for r in _evals(results, d))
        ),
        "dense_ppl": _get(results, "dense", corpus, "perplexity"),
        "pipeline_seconds": _round(results.get("seconds")),
        "train_seconds": _round(report.get("seconds")),
        "steps": extra.get("steps", len(loss) if loss else config.get("steps")),
        "batch_size": config.get("batch_size"),
        "grad_accum": config.get("grad_accum"),
        "seq_len": _get(results, "options", "seq_len"),
        "tokens": tokens,
        "tokens_formula": formula,
        "prior_hard_ppl": next((h["hard_ppl"] for h in hard if h.get("step") == 0), None),
        "final_hard_ppl": hard[-1]["hard_ppl"] if hard else None,
        "final_lm_loss": (loss[-1].get("lm_loss", loss[-1].get("loss")) if loss else None),
        "blocks": len(extra["block_curves"])
        if isinstance(extra.get("block_curves"), list)
        else None,
        "method_config": config,
        "lmcompress": _get(manifest, "versions", "lmcompress"),
    }
    curves = {
        "loss": loss,
        "hard_ppl": [{"step": h.get("step"), "hard_ppl": h["hard_ppl"]} for h in hard],
        # block-wise runs: whatever per-block curves the method reports, kept as they are
        "blocks": {k: v for k, v in extra.items() if "block" in k.lower()},
        "other": {
            k: v
            for k, v in extra.items()
            if k not in CURVE_KEYS and "block" not in k.lower() and isinstance(v, (list, dict))
        },
        "ppl": row["ppl"],
        "steps": row["steps"],
    }
    return row, curves


def _evals(results: dict, key: str) -> list[dict]:
    return [r for r in (results.get(key) or {}).values() if isinstance(r, dict)]


def _round(value: Any, digits: int = 1) -> Any:
    return round(value, digits) if isinstance(value, (int, float)) else value


def run_config(
    name: str, spec: dict[str, Any], settings: dict[str, Any], work: Path, keep: Path | None
) -> tuple[dict, dict]:
    """Run one configuration; its (row, curves)."""
    from lmcompress.compressor.export import read_manifest

    out = (keep or work) / name
    shutil.rmtree(out, ignore_errors=True)
    cmd = build_command(list(spec["args"]), out, settings)
    log.info("%s: %s", name, " ".join(cmd[len(CLI) :]))
    wall, rss = timed_run(cmd, work / f"{name}.log")
    row, curves = parse_manifest(read_manifest(out), settings["eval"])
    row = {
        "name": name,
        "args": list(spec["args"]),
        "note": spec.get("note", ""),
        "wall_seconds": round(wall, 1),
        "peak_rss_mb": round(rss, 1),
        **row,
        "settings": dict(settings),
        "command": cmd[len(CLI) :],
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    if keep is None:
        shutil.rmtree(out, ignore_errors=True)
    return row, curves


# --- results files ------------------------------------------------------------------------


def merge_rows(old: list[dict], new: list[dict]) -> list[dict]:
    """``old`` with every row named in ``new`` replaced; CONFIGS order, then the rest by name."""
    rows = {r["name"]: r for r in old}
    rows.update({r["name"]: r for r in new})
    order = {name: i for i, name in enumerate(CONFIGS)}
    return sorted(rows.values(), key=lambda r: (order.get(r["name"], len(order)), r["name"]))


def merge_curves(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    return {**old, **new}


def _read_json(path: Path, default: Any) -> Any:
    return json.loads(path.read_text()) if path.is_file() else default


def load_baselines(results_dir: Path, corpus: str = "wiki-test") -> list[dict]:
    """The one-shot rows: ``{name, source, ppl, wall_seconds, peak_rss_mb, tokens}``."""
    pruning = _read_json(results_dir / "pruning.json", {})
    magnitude = _read_json(results_dir / "magnitude.json", {})
    calib = _get(pruning, "settings", "nsamples"), _get(pruning, "settings", "seq_len")
    rows = []
    for name, method, sparsity in BASELINES:
        found = next(
            (
                r
                for r in pruning.get("results", [])
                if r.get("method") == method
                and r.get("sparsity") == sparsity
                and r.get("tool") in ("lmcompress", "-")
            ),
            None,
        )
        if found is not None:
            ppl = _get(found, "ppl", corpus, "perplexity")
            source = "pruning.json"
        else:  # magnitude.json names its rows "dense", "magnitude 2:4"
            found = next((r for r in magnitude.get("results", []) if r.get("name") == name), None)
            if found is None:
                continue
            ppl = _get(found, corpus, "perplexity")
            source = "magnitude.json"
        one_shot = method in ("wanda", "sparsegpt") and None not in calib
        rows.append(
            {
                "name": name,
                "source": source,
                "ppl": ppl,
                # magnitude.json's dense wall/RSS are of an eval process: not comparable
                "wall_seconds": found.get("wall_seconds") if method != "dense" else None,
                "peak_rss_mb": found.get("peak_rss_mb") if method != "dense" else None,
                "tokens": calib[0] * calib[1] if one_shot else (0 if method != "dense" else None),
            }
        )
    return rows


def ratio(ppl: float | None, reference: float | None) -> float | None:
    """``ppl / reference`` (None when either is missing)."""
    if ppl is None or not reference:
        return None
    return ppl / reference


def reference_ppl(baselines: list[dict]) -> float | None:
    return next((b["ppl"] for b in baselines if b["name"] == REFERENCE), None)


def _fmt(value: Any, spec: str = "") -> str:
    if value is None:
        return "-"
    return format(value, spec) if spec else str(value)


def table_rows(results: list[dict], baselines: list[dict]) -> list[list[str]]:
    ref = reference_ppl(baselines)
    rows = []
    for b in baselines:
        rows.append(
            [
                b["name"],
                f"baseline ({b['source']})",
                _fmt(b["ppl"], ".2f"),
                _fmt(ratio(b["ppl"], ref), ".3f"),
                _fmt(b["wall_seconds"]),
                "-",
                _fmt(b["peak_rss_mb"]),
                f"{b['tokens']:,} (calib)" if b["tokens"] else _fmt(b["tokens"]),
                "-",
                "-",
                "-",
                "one-shot",
            ]
        )
    for r in results:
        rows.append(
            [
                r["name"],
                "maskllm (this script)",
                _fmt(r.get("ppl"), ".2f"),
                _fmt(ratio(r.get("ppl"), ref), ".3f"),
                _fmt(r.get("wall_seconds")),
                _fmt(r.get("eval_seconds")),
                _fmt(r.get("peak_rss_mb")),
                _fmt(r.get("tokens"), ",") if r.get("tokens") is not None else "-",
                _fmt(r.get("steps")),
                _fmt(r.get("train_seconds")),
                " → ".join(
                    _fmt(r.get(k), ".2f") for k in ("prior_hard_ppl", "final_hard_ppl") if r.get(k)
                )
                or "-",
                "`" + " ".join(r.get("args", [])) + "`",
            ]
        )
    return rows


HEADER = [
    "config",
    "source",
    "{corpus} ppl",
    f"÷ {REFERENCE}",
    "wall s",
    "of which eval s",
    "peak RSS MB",
    "train tokens",
    "steps",
    "train s",
    "hard ppl step 0 → last",
    "args",
]


def render(results: list[dict], baselines: list[dict], settings: dict[str, Any]) -> str:
    ref = reference_ppl(baselines)
    head = (
        f"MaskLLM (learned {settings.get('sparsity', '2:4')} masks) on SmolLM2-135M "
        f"(`{settings.get('checkpoint')}`), every linear in the decoder blocks; "
        f"{settings.get('nsamples')} windows × {settings.get('seq_len')} tokens of "
        f"{settings.get('calib')} (seed {settings.get('seed')}), of which `--eval-windows` are "
        f"held out for the hard-mask ppl; wiki-test ppl at seq-len {settings.get('seq_len')} over "
        f"the first {settings.get('eval_tokens')} tokens, as for the baselines.\n\n"
        "Baseline rows are not rerun here: they come from `results/pruning.json` "
        "(`benchmarks/pruning.py`, ours) or `results/magnitude.json`, as marked; their wall/RSS "
        "are the compression process without evaluation, their tokens the calibration windows. "
        "MaskLLM wall/RSS: the whole `compress-model` process incl. the one-shot prior and the "
        'wiki-test evaluation ("of which eval s"; subtract it to compare with the baselines). '
        f"÷ {REFERENCE}: wiki-test ppl / {_fmt(ref, '.2f')} (goal ≤ {GOAL}). Train tokens: "
        "steps × batch_size × grad_accum × seq_len (the prior's calibration pass not counted). "
        "Hard ppl: the method's own, on the held-out wiki-calib windows (step 0 = the prior's "
        "mask). Timings depend on other load on the 2-core machine.\n\n"
    )
    notes = []
    for r in results:
        line = f"- **{r['name']}**: {r.get('note') or '-'}"
        differ = {
            k: v for k, v in (r.get("settings") or {}).items() if settings.get(k) not in (None, v)
        }
        if differ:
            line += f" (run with different settings: {differ})"
        if r.get("finished"):
            line += f" [run {r['finished']}]"
        notes.append(line)
    corpus = settings.get("eval") or "wiki-test"
    body = markdown_table([h.format(corpus=corpus) for h in HEADER], table_rows(results, baselines))
    return head + body + ("\n" + "\n".join(notes) + "\n" if notes else "")


# --- plot ---------------------------------------------------------------------------------


def _xs(entries: list[dict]) -> list[int]:
    """Steps, or the entry index when steps restart (one curve per block, concatenated)."""
    steps = [e.get("step") for e in entries]
    if all(isinstance(s, (int, float)) for s in steps) and all(
        a < b for a, b in zip(steps, steps[1:], strict=False)
    ):
        return steps
    return list(range(1, len(entries) + 1))


def _smooth(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _loss(entry: dict) -> float | None:
    return entry.get("lm_loss", entry.get("loss"))


def block_losses(curve: dict[str, Any]) -> list[dict]:
    """The per-block curves of a block-wise run (``report.extra.block_curves``:
    ``[{block, curve: [{step, loss, ...}]}]``) concatenated; [] if absent or another shape."""
    blocks = (curve.get("blocks") or {}).get("block_curves")
    if not isinstance(blocks, list):
        return []
    out = []
    for block in blocks:
        if isinstance(block, dict) and isinstance(block.get("curve"), list):
            out += [
                {**e, "block": block.get("block")} for e in block["curve"] if isinstance(e, dict)
            ]
    return out


def _block_errors(curve: dict[str, Any], edge: int = 5) -> list[tuple[int, float, float]]:
    """(block, mean rel_err of its first ``edge`` steps, of its last ``edge`` steps)."""
    blocks = (curve.get("blocks") or {}).get("block_curves") or []
    out = []
    for block in blocks:
        errs = [e["rel_err"] for e in block.get("curve", []) if e.get("rel_err") is not None]
        if errs:
            head, tail = errs[:edge], errs[-edge:]
            out.append((block.get("block"), sum(head) / len(head), sum(tail) / len(tail)))
    return out


def plot_curves(curves: dict[str, Any], baselines: list[dict], path: Path) -> None:
    """Four panels. End-to-end configs: (a) hard-mask ppl vs step (★ = final wiki-test ppl),
    (b) LM loss vs step. Block-wise configs: (c) wiki-test ppl vs steps per block (0 = SparseGPT
    2:4, which block-wise learning with no learning reduces to: a tested identity), (d) each
    block's relative error at the start and the end of its training (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    (hard_ax, loss_ax), (steps_ax, block_ax) = axes
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    ref = reference_ppl(baselines)
    blockwise_points = []
    for i, (name, curve) in enumerate(sorted(curves.items())):
        color = colors[i % len(colors)]
        errors = _block_errors(curve)
        if errors:
            if curve.get("ppl") is not None and curve.get("steps"):
                blockwise_points.append((curve["steps"], curve["ppl"], name))
            xs = [b for b, _, _ in errors]
            block_ax.plot(xs, [h for _, h, _ in errors], ":", color=color, alpha=0.6)
            block_ax.plot(
                xs,
                [t for _, _, t in errors],
                "o-",
                color=color,
                markersize=3,
                label=f"{name}: first 5 steps (dotted) → last 5",
            )
            continue
        hard = [h for h in curve.get("hard_ppl") or [] if h.get("hard_ppl") is not None]
        if hard:
            hard_ax.plot(_xs(hard), [h["hard_ppl"] for h in hard], "o-", color=color, label=name)
            if curve.get("ppl") is not None:
                hard_ax.plot(_xs(hard)[-1], curve["ppl"], "*", color=color, markersize=12)
        loss = [e for e in curve.get("loss") or [] if isinstance(e, dict) and _loss(e) is not None]
        if loss:
            ys = [_loss(e) for e in loss]
            loss_ax.plot(_xs(loss), ys, "-", color=color, alpha=0.25, linewidth=0.8)
            loss_ax.plot(
                _xs(loss), _smooth(ys, max(1, len(ys) // 20)), "-", color=color, label=name
            )
    if blockwise_points:
        points = sorted(blockwise_points)
        xs = ([0] if ref else []) + [p[0] for p in points]
        ys = ([ref] if ref else []) + [p[1] for p in points]
        steps_ax.plot(xs, ys, "o-", color="tab:green", label="block-wise + re-fit")
        for x, y, name in points:
            steps_ax.annotate(name, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    for ax in (hard_ax, steps_ax):
        if ref:
            ax.axhline(ref, color="black", linestyle="--", label=f"{REFERENCE} wiki-test {ref:.1f}")
            ax.axhline(GOAL * ref, color="gray", linestyle=":", label=f"{GOAL} × {REFERENCE}")
    hard_ax.set(
        title="end to end: hard-mask ppl (held-out calib windows; ★ wiki-test)",
        xlabel="step",
        ylabel="perplexity",
    )
    loss_ax.set(
        title="end to end: LM loss (faint: per step; thick: moving average)",
        xlabel="step",
        ylabel="loss",
    )
    steps_ax.set(
        title="block-wise: wiki-test ppl vs steps per block (0 = SparseGPT 2:4)",
        xlabel="steps per block",
        ylabel="perplexity",
    )
    block_ax.set(
        title="block-wise: relative error of each block's output",
        xlabel="block",
        ylabel="‖f(x̃) − y‖² / ‖y − x‖²",
    )
    for ax in axes.flat:
        if not ax.get_lines():
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
            continue
        ys = [y for line in ax.get_lines() for y in line.get_ydata()]
        if ys and min(ys) > 0 and ax is not loss_ax:
            ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_outputs(
    results_dir: Path,
    results: list[dict],
    curves: dict[str, Any],
    settings: dict[str, Any],
    machine_info: dict[str, Any] | None = None,
) -> str:
    """Write maskllm.json, maskllm_curves.json, maskllm.md and maskllm_curves.png; the md."""
    results_dir.mkdir(parents=True, exist_ok=True)
    baselines = load_baselines(results_dir, settings.get("eval", "wiki-test"))
    ref = reference_ppl(baselines)
    for r in results:
        r["ratio_to_sparsegpt"] = _round(ratio(r.get("ppl"), ref), 4)
    old = _read_json(results_dir / "maskllm.json", {})
    payload = {
        "settings": settings,
        "machine": machine_info or old.get("machine"),
        "baselines": baselines,
        "results": results,
    }
    (results_dir / "maskllm.json").write_text(json.dumps(payload, indent=2) + "\n")
    (results_dir / "maskllm_curves.json").write_text(json.dumps(curves, indent=1) + "\n")
    table = render(results, baselines, settings)
    (results_dir / "maskllm.md").write_text(table)
    plot_curves(curves, baselines, results_dir / "maskllm_curves.png")
    return table


# --- main ---------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", metavar="NAME", help=f"of {', '.join(CONFIGS)}")
    parser.add_argument("--list", action="store_true", help="print the configurations and exit")
    parser.add_argument("--render-only", action="store_true", help="redraw md/png from the JSON")
    parser.add_argument("--checkpoint", default="smollm2-135m")
    parser.add_argument("--sparsity", default="2:4")
    parser.add_argument("--calib", default="wiki-calib")
    parser.add_argument("--eval", default="wiki-test", help="the one corpus scored")
    parser.add_argument("--nsamples", type=int, default=128, help="calibration/training windows")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-tokens", type=int, default=32768)
    parser.add_argument("--results-dir", default=str(HERE / "results"))
    parser.add_argument("--work", help="logs (and outputs) here; default: a temporary directory")
    parser.add_argument("--keep", help="keep each output directory as KEEP/NAME")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    results_dir = Path(args.results_dir)

    if args.list:
        for name, spec in CONFIGS.items():
            print(f"{name}: {' '.join(spec['args'])}\n    {spec.get('note', '')}")
        return 0
    previous = _read_json(results_dir / "maskllm.json", {})
    old_rows = previous.get("results", [])
    old_curves = _read_json(results_dir / "maskllm_curves.json", {})
    if args.render_only:
        table = write_outputs(results_dir, old_rows, old_curves, previous.get("settings", {}))
        print(table)
        return 0
    if not args.configs:
        parser.error("give --configs NAME [NAME ...] (or --list / --render-only)")
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown config(s) {', '.join(unknown)}; known: {', '.join(CONFIGS)}")

    from common import machine

    settings = {
        k: getattr(args, k)
        for k in ("checkpoint", "sparsity", "calib", "eval", "nsamples", "seq_len", "seed")
    }
    settings["eval_tokens"] = args.eval_tokens
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="lmcompress-maskllm-"))
    work.mkdir(parents=True, exist_ok=True)
    keep = Path(args.keep) if args.keep else None
    if keep:
        keep.mkdir(parents=True, exist_ok=True)
    failed = []
    rows, curves = old_rows, old_curves
    for name in args.configs:
        try:
            row, curve = run_config(name, CONFIGS[name], settings, work, keep)
        except Exception as err:  # noqa: BLE001 - one failed config must not lose the others
            log.error("%s failed (log in %s):\n%s", name, work / f"{name}.log", err)
            failed.append(name)
            continue
        log.info("%s: wiki-test ppl %s, wall %s s", name, row["ppl"], row["wall_seconds"])
        rows = merge_rows(rows, [row])
        curves = merge_curves(curves, {name: curve})
        # written after every config: a later failure or kill keeps the finished ones
        table = write_outputs(results_dir, rows, curves, settings, machine())
    if len(failed) < len(args.configs):
        print(table)
    if failed:
        log.error("failed: %s (work directory %s kept)", ", ".join(failed), work)
        return 1
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
