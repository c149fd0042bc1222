"""The MaskLLM benchmark's results: a run's row and curves parsed from its ``compression.json``,
the one-shot baselines read from ``pruning.json`` / ``magnitude.json``, and the markdown table
(``render(payload)``, a pure function of ``maskllm.json``). See ``benchmarks/maskllm.py`` for
what every column means."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from benchmarks.render import markdown_table, read_json

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
        "eval_seconds": rounded(
            sum(r.get("seconds", 0.0) for d in ("compressed", "dense") for r in _evals(results, d))
        ),
        "dense_ppl": _get(results, "dense", corpus, "perplexity"),
        "pipeline_seconds": rounded(results.get("seconds")),
        "train_seconds": rounded(report.get("seconds")),
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


def rounded(value: Any, digits: int = 1) -> Any:
    return round(value, digits) if isinstance(value, (int, float)) else value


def load_baselines(results_dir: Path, corpus: str = "wiki-test") -> list[dict]:
    """The one-shot rows: ``{name, source, ppl, wall_seconds, peak_rss_mb, tokens}``."""
    pruning = read_json(results_dir / "pruning.json", {})
    magnitude = read_json(results_dir / "magnitude.json", {})
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
            # a row the sweep (re)ran keeps its scores under "ppl"
            ppl = _get(found, corpus, "perplexity") or _get(found, "ppl", corpus, "perplexity")
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
    "peak RSS MiB",
    "train tokens",
    "steps",
    "train s",
    "hard ppl step 0 → last",
    "args",
]


def render_table(results: list[dict], baselines: list[dict], settings: dict[str, Any]) -> str:
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


def render(payload: dict[str, Any]) -> str:
    """``maskllm.md`` from ``maskllm.json`` (its stored baselines: a rendering reads no other
    file)."""
    return render_table(payload["results"], payload["baselines"], payload["settings"])
