"""The low-rank table's own code (``benchmarks/tables/lowrank.yaml``): its row kinds, its
columns, the paragraphs under it and its figure.

Row kinds (``benchmarks.table.KINDS``), each a process of its own (``benchmarks.child.lowrank``):

- ``lowrank_stats``: one calibration pass of the dense model (``statistics: activations``, for
  ASVD and SVD-LLM; ``gradients``, for FWSVD and both GFWSVD variants), cached under
  ``WORK/stats`` for the rows (a row rerun alone needs them there: ``--work`` of the run that
  collected them);
- ``lowrank``: factorise with the cached statistics and score (its recipe: the method, its
  options, ``variant``: block by block, ``residual``: then SparseGPT on ``W - B A``);
- ``end_to_end``: ``compress-model`` with the recipe (as flags, or ``--config FILE``), the dense
  model neither scored nor copied, then ``compress-model eval --runtime packed`` of its output.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from benchmarks.readers import Record, number, row_name
from benchmarks.runner import CLI, PYTHON, STDOUT, Job, Run

if TYPE_CHECKING:
    from benchmarks.columns import Cell, Context

KINDS = ("lowrank_stats", "lowrank", "end_to_end")
LABELS = {
    "svd": "SVD",
    "asvd": "ASVD (α 0.5)",
    "svd-llm": "SVD-LLM",
    "fwsvd": "FWSVD",
    "gfwsvd": "GFWSVD (K-FAC factors)",
    "gfwsvd-nearest": "GFWSVD (nearest Kronecker)",
}
STATISTICS = {  # a row's method -> the statistics row whose cached files it reads
    "asvd": "stats:activations",
    "svd-llm": "stats:activations",
    "fwsvd": "stats:gradients",
    "gfwsvd": "stats:gradients",
    "gfwsvd-nearest": "stats:gradients",
}
END_TO_END = {  # the end-to-end rows: what their wall time includes
    "cli": "gradient pass on 32 windows",
    "recipe": "gradient pass on 128 windows, block-by-block pass and distillation on 512",
}
NSAMPLES_TEXT = "the same 128 calibration windows"
VARIANT_MARKERS = {"refit": "^", "sequential": "s", "sequential+refit": "D", "distill": "P",
                   "distill lr 1e-4": "X", "distill lr 3e-4": "v"}  # fmt: skip


def run_lowrank(name: str, kind: str, recipe: Any, settings: Record, work: Path, run) -> Record:
    """One row of a low-rank kind (module docstring); ``run(job)`` -> its :class:`Run`."""
    measured = lambda done: {"wall_seconds": done.wall_seconds, "peak_rss_mb": done.peak_rss_mb}  # noqa: E731
    child, stats = (PYTHON, "-m", "benchmarks.child.lowrank"), str(work / "stats")
    if kind == "end_to_end":
        return _end_to_end(name, recipe, settings, work, run)
    if kind == "lowrank_stats":
        command = (*child, "stats", recipe["statistics"], stats, json.dumps(settings))
        done = run(Job(name, command, STDOUT))
        return {"name": name, **done.result, **measured(done)}
    spec = {"name": name, **recipe}
    done = run(Job(name, (*child, "apply", json.dumps(spec), stats, json.dumps(settings)), STDOUT))
    return {**spec, **done.result, **measured(done)}


def _end_to_end(name: str, recipe: Any, settings: Record, work: Path, run) -> Record:
    what = recipe if isinstance(recipe, dict) else yaml.safe_load(Path(recipe).read_text())
    what = what.get("stages", [what])[0]  # the (first) method, for the record
    out = work / "outputs" / (Path(recipe).stem if isinstance(recipe, str) else
                              f"{what['method']}-{what['ratio']:g}")  # fmt: skip
    corpora, tokens = list(settings["corpora"]), str(settings["eval_tokens"])
    given = ("--config", recipe) if isinstance(recipe, str) else (settings["checkpoint"],)
    given += () if isinstance(recipe, str) else tuple(_flags(recipe))
    command = (*CLI, *given, "--eval", *corpora, "--skip-dense", "--eval-tokens", tokens,
               "--no-dense-copy", "--overwrite", "-o", str(out), "-q")  # fmt: skip
    done: Run = run(Job(name, command, out / "compression.json"))
    manifest = done.result
    reload = (*CLI, "eval", str(out), "--runtime", "packed", "--data", *corpora)
    reloaded = run(
        Job(f"{name} reload", (*reload, "--eval-tokens", tokens, "--json", "-q"), STDOUT)
    )
    layers = manifest["report"]["layers"]
    kept, params = sum(x["params_kept"] for x in layers), sum(x["params"] for x in layers)
    return {
        "name": name,
        "method": what["method"],
        "ratio": what["ratio"],
        "command": " ".join(str(c) for c in command[2:]).replace(str(work), "WORK"),
        "wall_seconds": done.wall_seconds,
        "peak_rss_mb": done.peak_rss_mb,
        "params_kept_fraction": kept / params,
        "ppl": {c: manifest["results"]["compressed"][c]["perplexity"] for c in corpora},
        "reloaded_ppl": {c: reloaded.result["perplexity"][c]["perplexity"] for c in corpora},
        "reload_peak_rss_mb": reloaded.peak_rss_mb,
        "compressed_bytes": (out / "compressed.safetensors").stat().st_size,
        # the fp32 factors; the header is the rest (a layer left dense is in model.safetensors)
        "expected_bytes": 4 * sum(x["params_kept"] for x in layers if x.get("rank")),
    }


def _flags(recipe: Record) -> list[str]:
    return [part for k, v in recipe.items() for part in (f"--{k.replace('_', '-')}", str(v))]


def _label(row: Record, _context: Context) -> str:
    if row["method"] in ("dense", "sparsegpt"):
        return {"dense": "dense", "sparsegpt": "SparseGPT 2:4"}[row["method"]]
    label = LABELS[row["method"]] + (f", {row['variant']}" if row.get("variant") else "")
    return label + (f", SparseGPT {row['residual']} on the residual" if row.get("residual") else "")


def _ratio(row: Record, _context: Context) -> str:
    return {"dense": "1", "sparsegpt": "-"}.get(row["method"]) or f"{row['ratio']:g}"


def _ranks(row: Record, _context: Context) -> str:
    return "-" if row["method"] in ("dense", "sparsegpt") else row["allocation"]


def _kept(row: Record, _context: Context) -> str:
    return "100" if row["method"] == "dense" else f"{100 * row['params_kept_fraction']:.2f}"


def _factorise(row: Record, _context: Context) -> str:
    return "-" if row["method"] == "dense" else f"{row['apply_seconds']:.1f}"


def _statistics(row: Record, context: Context) -> str:
    stats = context.rows.get(STATISTICS.get(row["method"], ""))
    return (
        "-" if stats is None else f"{stats['wall_seconds']:.0f} s / {stats['peak_rss_mb']:.0f} MiB"
    )


CELLS = {"label": _label, "ratio": _ratio, "ranks": _ranks, "kept": _kept,
         "factorise": _factorise, "statistics": _statistics}  # fmt: skip
# family:ARG -> (header, (arg, digits) -> cell, default digits): columns.FAMILIES'
LOWRANK_FAMILIES: dict[str, tuple[str, Callable[[str, int], Cell], int]] = {
    "lowrank": ("{}", lambda which, _digits: CELLS[which], 0),  # lowrank:label, ...
}


def note(payload: Record, _settings: Any) -> str:
    """The results file's own note, after a space (caption variable ``note``)."""
    return f" {payload['note']}" if payload.get("note") else ""


def paragraphs(payload: Record, _rows: list[Record]) -> str:
    """Under the table: the gradient pass, the combined row, each end-to-end row."""
    rows = {row_name(r): r for r in payload["results"]}
    nsamples = {**payload, **payload.get("settings", {})}["nsamples"]
    found = []
    if "stats:gradients" in rows:
        gradients = rows["stats:gradients"]
        iters = gradients["power_iterations"]
        found.append(
            f"Gradient pass: {gradients['pass_seconds']:.0f} s for {nsamples} windows "
            f"({gradients['samples']} backward passes of 8 windows: the per-sample gradients of "
            f"the nearest Kronecker product); power iterations {gradients['power_seconds']:.0f} s "
            f"({min(iters)}–{max(iters)} per layer); peak RSS of the whole job "
            f"{gradients['peak_rss_mb']:.0f} MiB."
        )
    if "combined" in rows:
        row = rows["combined"]
        found.append(
            f"Combined: GFWSVD (K-FAC) at ratio {row['ratio']:g} on the MLP layers, then "
            f"SparseGPT 2:4 on the attention layers ({NSAMPLES_TEXT}): "
            f"{100 * row['params_kept_fraction']:.2f} % of the parameters kept (non-zeros), "
            f"wiki-test {_ppl(row, 'wiki-test')}, lee {_ppl(row, 'lee')}; factorise "
            f"{row['apply_seconds']:.1f} s, SparseGPT {row['sparsegpt_seconds']:.0f} s."
        )
    found += [_end_to_end_paragraph(rows[name], what) for name, what in END_TO_END.items()
              if name in rows]  # fmt: skip
    return "".join(f"\n\n{text}\n" for text in found)


def _ppl(row: Record, corpus: str) -> str:
    return number(row.get("ppl", {}).get(corpus), 2)


def _end_to_end_paragraph(row: Record, what: str) -> str:
    ratio = row["compressed_bytes"] / row["expected_bytes"]
    threads = row.get("machine", {}).get("torch_threads")  # a row merged from elsewhere
    return (
        f"End to end{f', {threads} threads' if threads else ''}: `{row['command']}`: "
        f"{row['wall_seconds']:.0f} s, peak RSS {row['peak_rss_mb']:.0f} MiB ({what} "
        f"included); kept {100 * row['params_kept_fraction']:.2f} %; "
        f"`compressed.safetensors` {row['compressed_bytes']:,} bytes = {ratio:.4f} × the "
        f"fp32 bytes of the factorised layers' factors (the rest is its header); "
        f"perplexity wiki-test {_ppl(row, 'wiki-test')} / lee {_ppl(row, 'lee')}, reloaded "
        f"by `compress-model eval --runtime packed`: {row['reloaded_ppl']['wiki-test']:.2f} "
        f"/ {row['reloaded_ppl']['lee']:.2f}."
    )


def plot(payload: Record, _results_dir: Path, path: Path, corpora: list[str]) -> None:
    """Per corpus, perplexity against the parameters kept: a line per method and ranks
    (uniform, greedy; a lone point a marker), the block-by-block rows as markers of their own,
    the dense model's as a dotted line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [
        r for r in payload["results"]
        if r.get("allocation") in ("uniform", "greedy") and not r.get("residual")
    ]  # fmt: skip
    variants = [r for r in rows if r.get("variant")]  # block by block: markers of their own
    rows = [r for r in rows if not r.get("variant")]
    dense = next((r for r in payload["results"] if r["name"] == "dense"), None)
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.4), sharex=True)
    for ax, corpus in zip(axes, corpora, strict=True):
        for i, method in enumerate(LABELS):
            for allocation, style in (("uniform", "-"), ("greedy", "--")):
                points = sorted(
                    (r["ratio"], r["ppl"][corpus])
                    for r in rows
                    if r["method"] == method and r["allocation"] == allocation
                )
                marker = "o"
                if len(points) == 1:  # a lone point: no line
                    style, marker = "none", "x" if allocation == "greedy" else "o"
                if points:
                    xs, ys = zip(*points, strict=True)
                    label = f"{LABELS[method]}{' greedy' if allocation == 'greedy' else ''}"
                    ax.plot(xs, ys, linestyle=style, color=f"C{i}", marker=marker, label=label)
        for row in variants:
            marker = VARIANT_MARKERS.get(row["variant"], "*")
            ax.scatter(row["ratio"], row["ppl"][corpus], marker=marker, facecolors="none",
                       color=f"C{list(LABELS).index(row['method'])}",
                       label=f"{LABELS[row['method']]} greedy, {row['variant']}")  # fmt: skip
        if dense:
            ax.axhline(dense["ppl"][corpus], color="black", lw=0.8, ls=":", label="dense")
        ax.set_yscale("log")
        ax.set_xlabel("fraction of decoder-linear parameters kept")
        ax.set_title(f"SmolLM2-135M, {corpus}")
    axes[0].set_ylabel("perplexity (log scale)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="center right")
    fig.tight_layout(rect=(0, 0, 0.8, 1))
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)
