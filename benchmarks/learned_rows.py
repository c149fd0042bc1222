"""What the tables of learned masks keep beyond a recipe row (``kind: learned`` in
``benchmarks/tables/``): the method's own training record; the rows of stages that each run as a
process of their own (``kind: stages``: a later stage reads an earlier one's output); and the
one-shot rows they copy from another results file (``copy:``) rather than rerun."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.notes import as_flags
from benchmarks.readers import perplexity, row_name
from benchmarks.render import read_json, write_json
from benchmarks.runner import CLI
from benchmarks.table import Copy, Row

Record = dict[str, Any]
log = logging.getLogger(__name__)


def learned_of(manifest: Record, recipe: Record | str) -> Record:
    """A learned row's record beyond :func:`benchmarks.sweep.record_of`: the method's seconds
    (prior, training, extraction, re-fit), its steps and held-out hard-mask perplexities, each
    block's hard-mask error before and after training (block-wise), the sparsity achieved over
    the compressed layers, the evaluation's seconds, its options as flags and when it ended."""
    report, results = manifest.get("report", {}), manifest.get("results", {})
    extra, layers = report.get("extra") or {}, report.get("layers") or []
    kept = sum(layer.get("params_kept", 0) for layer in layers)
    total = sum(layer.get("params", 0) for layer in layers) or 1
    scored = [v for v in (results.get("compressed") or {}).values() if isinstance(v, dict)]
    seconds, options = report.get("seconds"), recipe if isinstance(recipe, dict) else {}
    return {
        "args": as_flags({k: v for k, v in options.items() if k not in ("method", "sparsity")}),
        "eval_seconds": round(sum(v.get("seconds") or 0.0 for v in scored), 1),
        "train_seconds": None if seconds is None else round(seconds, 1),
        "steps": extra.get("steps"),
        "tokens": stage_tokens(manifest, (results.get("options") or {}).get("seq_len", 0)),
        "achieved_sparsity": 1.0 - kept / total,
        "hard_ppl": extra.get("hard_ppl", []),
        "block_hard": [
            {k: b.get(k) for k in ("block", "hard_before", "hard_after")}
            for b in extra.get("block_curves") or []
        ],
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
        "curves": curves_of(manifest),
    }


def curves_of(manifest: Record) -> Record:
    """A learned row's curves (``curves: true`` keeps them in ``NAME_curves.json``, by row):
    the loss and held-out hard-mask perplexity by step, the per-block curves of a block-wise
    run and any other list the method reports, as they are; the final perplexity and steps."""
    extra = (manifest.get("report") or {}).get("extra") or {}
    compressed = (manifest.get("results") or {}).get("compressed") or {}
    loss = [h for h in extra.get("loss_curve") or [] if isinstance(h, dict)]
    hard = [h for h in extra.get("hard_ppl") or [] if isinstance(h, dict) and "hard_ppl" in h]
    known = ("loss_curve", "hard_ppl", "steps", "tokens")
    return {
        "loss": loss,
        "hard_ppl": [{"step": h.get("step"), "hard_ppl": h["hard_ppl"]} for h in hard],
        "blocks": {k: v for k, v in extra.items() if "block" in k.lower()},
        "other": {
            k: v
            for k, v in extra.items()
            if k not in known and "block" not in k.lower() and isinstance(v, (list, dict))
        },  # fmt: skip
        "ppl": next(
            (v.get("perplexity") for v in compressed.values() if isinstance(v, dict)), None
        ),
        "steps": extra.get("steps", len(loss) or None),
    }


def copied_rows(
    sources: list[str], rows: dict[str, list[str]], results_dir: Path, corpora: list[str]
) -> list[Record]:
    """The rows ``rows`` (our name -> its names there) of the first of ``results_dir``'s
    ``SOURCE.json`` files that has one, as this table draws them (``source`` names the file; the
    perplexities bare numbers; ``tokens``: a one-shot row's calibration tokens, 0 for
    magnitude; a dense row's wall and RSS, of an eval process, left out); a row no file has is
    left out."""
    files = [(s, read_json(results_dir / f"{s}.json") or {}) for s in sources]
    copied = []
    for name, theirs in rows.items():
        found = [(s, f, r) for s, f in files for r in f.get("results", []) if row_name(r) in theirs]
        if not found:
            continue
        source, payload, row = found[0]
        method, settings = row.get("method"), payload.get("settings", {})
        copy = {"name": name, "method": method, "sparsity": row.get("sparsity")}
        copy["ppl"] = {c: perplexity(row, c) for c in corpora}
        if method != "dense":
            copy.update({k: row[k] for k in ("wall_seconds", "peak_rss_mb") if k in row})
            calib = settings.get("nsamples", 0) * settings.get("seq_len", 0)
            copy["tokens"] = calib if method in ("wanda", "sparsegpt") else 0
        copied.append({**copy, "source": f"{source}.json"})
    return copied


def stage_tokens(manifest: Record, seq_len: int) -> int:
    """Training tokens of one stage (0 for a one-shot method): the method's count where it
    gives one (block-wise: the windows through each block, once), else steps × batch × accum ×
    ``seq_len``."""
    report = manifest.get("report", {}) or {}
    extra, config = report.get("extra", {}) or {}, report.get("config", {}) or {}
    if extra.get("tokens") is not None:
        return int(extra["tokens"])
    training = config.get("training", config)
    batch = training.get("batch_size", 1) * training.get("grad_accum", 1)
    return int((extra.get("steps") or 0) * batch * seq_len)


def _stage(name: str, stage: Record, settings: Record, run: Callable, work: Path) -> Record:
    """One stage's process (``run(name, recipe, settings, out)`` -> (Run, its command)), or its
    stored run: a stage run before with the same recipe and settings (the same recipe prefix,
    e.g. the block-wise pass two rows start from) is reused, its measurements too
    (``reused``), from ``WORK/stages/<digest>``."""
    key = hashlib.sha1(json.dumps([stage, settings], sort_keys=True).encode()).hexdigest()[:12]
    stored = work / "stages" / key
    if (stored / "stage.json").is_file():
        log.info("%s: reusing the stage run in %s", name, stored)
        record = json.loads((stored / "stage.json").read_text())
        return {**record, "out": str(stored / "out"), "reused": True}
    out = work / "out"
    shutil.rmtree(out, ignore_errors=True)
    done, command = run(name, stage, settings, out)
    stored.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(stored / "out", ignore_errors=True)
    shutil.move(out, stored / "out")
    record = {"wall_seconds": done.wall_seconds, "peak_rss_mb": done.peak_rss_mb,
              "manifest": done.result, "command": command}  # fmt: skip
    (stored / "stage.json").write_text(json.dumps(record))
    return {**record, "out": str(stored / "out"), "reused": False}


def stage_job(stage: Record, outs: dict[str, str], settings: Record) -> tuple[Record, Record]:
    """A stage's recipe and settings, the earlier stages' outputs filled in (``{stage1}``): a
    ``checkpoint`` in the stage is the settings' (the model the stage compresses)."""
    spec = {k: v.format(**outs) if isinstance(v, str) else v for k, v in stage.items()}
    return spec, {**settings, "checkpoint": spec.pop("checkpoint", settings["checkpoint"])}


def run_stages(
    name: str, recipe: Record, settings: Record, work: Path, run_job: Callable, compress_job
) -> Record:
    """A ``stages`` row: each stage (a one-method recipe) a ``compress-model`` process of its
    own (``compress_job(row, out, settings, work)``, run by ``run_job(job)``), a later one
    naming an earlier one's output ``{stage1}`` (``prior_from``, or ``checkpoint``: compressed
    again); the row sums the stages' wall, train seconds and tokens, takes the largest peak RSS,
    and is scored by its last stage."""

    def run(name: str, recipe: Record, settings: Record, out: Path) -> tuple[Any, list[str]]:
        job = compress_job(Row(name, "recipe", recipe), out, settings, work)
        return run_job(job), [str(part) for part in job.command]

    corpora, outs, stages, commands, recipes = list(settings.get("corpora", ())), {}, [], [], []
    for index, spec in enumerate(recipe["stages"], start=1):
        spec, stage_settings = stage_job(spec, outs, settings)
        done = _stage(f"{name}.stage{index}", spec, stage_settings, run, work)
        outs[f"stage{index}"] = done["out"]
        manifest = done["manifest"]
        report, scored = manifest.get("report", {}) or {}, manifest.get("results", {})
        extra = report.get("extra") or {}
        stages.append({
            "method": spec["method"], "wall_seconds": done["wall_seconds"],
            "peak_rss_mb": done["peak_rss_mb"], "train_seconds": report.get("seconds"),
            "tokens": stage_tokens(manifest, settings["seq_len"]), "steps": extra.get("steps"),
            "hard_ppl": extra.get("hard_ppl", []),
            "ppl": {c: _ppl(scored.get("compressed", {}), c) for c in corpora},
            "reused": done["reused"],
        })  # fmt: skip
        commands.append(done["command"][len(CLI) :])
        recipes.append(spec)
    compressed = manifest.get("results", {}).get("compressed", {})
    train_s = sum(s["train_seconds"] or 0.0 for s in stages)
    tokens = sum(s["tokens"] for s in stages)
    return {
        "sparsity": str(recipe["stages"][0].get("sparsity", "-")),
        "stages": stages,
        "ppl": {c: _ppl(compressed, c) for c in corpora},
        "eval_seconds": sum((compressed.get(c) or {}).get("seconds") or 0.0 for c in corpora),
        "wall_seconds": sum(s["wall_seconds"] for s in stages),
        "peak_rss_mb": max((s["peak_rss_mb"] or 0.0 for s in stages), default=None),
        "train_seconds": train_s,
        "tokens": tokens,
        "tokens_per_second": tokens / train_s if tokens and train_s else None,
        "threads": os.environ.get("OMP_NUM_THREADS"),
        "commands": commands,
        "recipes": recipes,
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def _ppl(compressed: Record, corpus: str) -> float | None:
    return (compressed.get(corpus) or {}).get("perplexity")


def record_of_rows(copy: Copy | None, settings: Record, results_dir: Path, rows: list) -> Record:
    """A results file of ``rows``: the settings, and the rows ``copy:`` copies (``baselines``)."""
    corpora = list(settings.get("corpora", ()))
    copied = copy and copied_rows(copy.tables, copy.rows, results_dir, corpora)
    return {"settings": settings, **({"baselines": copied} if copy else {}), "results": rows}


def keep_curves(record: Record, path: Path | None) -> Record:
    """``record`` without its ``curves``, which go to ``path`` (by row name) where given."""
    curves = record.pop("curves", None)
    if path is not None and curves is not None:
        write_json(path, {**read_json(path, {}), record["name"]: curves}, indent=1)
    return record
