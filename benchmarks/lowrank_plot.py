"""The table and the picture of ``benchmarks.lowrank``: pure functions of its results JSON."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.render import markdown_table

CORPORA = ("wiki-test", "lee")
LABELS = {
    "svd": "SVD",
    "asvd": "ASVD (α 0.5)",
    "svd-llm": "SVD-LLM",
    "fwsvd": "FWSVD",
    "gfwsvd": "GFWSVD (K-FAC factors)",
    "gfwsvd-nearest": "GFWSVD (nearest Kronecker)",
}


def _ppl(row: dict[str, Any], corpus: str) -> str:
    value = row.get("ppl", {}).get(corpus)
    return "-" if value is None else f"{value:.2f}"


def _stats_cell(stats: dict[str, Any] | None) -> str:
    return (
        "-" if stats is None else f"{stats['wall_seconds']:.0f} s / {stats['peak_rss_mb']:.0f} MiB"
    )


def render(payload: dict[str, Any]) -> str:
    rows = {row["name"]: row for row in payload["results"]}
    stats = {
        "asvd": rows.get("stats:activations"),
        "svd-llm": rows.get("stats:activations"),
        "fwsvd": rows.get("stats:gradients"),
        "gfwsvd": rows.get("stats:gradients"),
        "gfwsvd-nearest": rows.get("stats:gradients"),
    }
    lines = [
        "# Low-rank compression of SmolLM2-135M (`python -m benchmarks.lowrank`)\n",
        f"Every linear in the decoder blocks; `ratio` = fraction of their parameters kept. "
        f"Statistics from the dense model on {payload['nsamples']} × {payload['seq_len']} "
        f"tokens of wiki-calib (seed 0), one job per kind (wall time / peak RSS in the "
        f"`statistics` column; the gradient job serves FWSVD and both GFWSVD variants and "
        f"includes the nearest-Kronecker power iterations). Perplexity at seq-len "
        f"{payload['seq_len']} over the first {payload['eval_tokens']} tokens of each corpus. "
        f"`factorise s`: `Method.apply`; `job RSS`: the process that factorised and scored."
        + (f" {payload['note']}" if payload.get("note") else "")
        + "\n",
    ]
    header = ["method", "ratio", "ranks", "kept %", "wiki-test ppl", "lee ppl",
              "factorise s", "job RSS MiB", "statistics"]  # fmt: skip
    table = []
    for row in payload["results"]:
        if row["name"].startswith("stats:") or row["name"] in ("combined", *END_TO_END):
            continue
        if row["name"] == "dense":
            table.append(["dense", "1", "-", "100", _ppl(row, "wiki-test"), _ppl(row, "lee"),
                          "-", f"{row['peak_rss_mb']:.0f}", "-"])  # fmt: skip
            continue
        if row["method"] == "sparsegpt":  # the baseline of the residual row
            table.append(["SparseGPT 2:4", "-", "-", f"{100 * row['params_kept_fraction']:.2f}",
                          _ppl(row, "wiki-test"), _ppl(row, "lee"), f"{row['apply_seconds']:.1f}",
                          f"{row['peak_rss_mb']:.0f}", "-"])  # fmt: skip
            continue
        label = LABELS[row["method"]] + (f", {row['variant']}" if row.get("variant") else "")
        if row.get("residual"):
            label += f", SparseGPT {row['residual']} on the residual"
        table.append([
            label, f"{row['ratio']:g}", row["allocation"],
            f"{100 * row['params_kept_fraction']:.2f}", _ppl(row, "wiki-test"), _ppl(row, "lee"),
            f"{row['apply_seconds']:.1f}", f"{row['peak_rss_mb']:.0f}",
            _stats_cell(stats.get(row["method"])),
        ])  # fmt: skip
    lines.append(markdown_table(header, table))
    gradients = rows.get("stats:gradients")
    if gradients:
        iters = gradients["power_iterations"]
        lines.append(
            f"\nGradient pass: {gradients['pass_seconds']:.0f} s for {payload['nsamples']} "
            f"windows ({gradients['samples']} backward passes of 8 windows: the per-sample "
            f"gradients of the nearest Kronecker product); power iterations "
            f"{gradients['power_seconds']:.0f} s ({min(iters)}–{max(iters)} per layer); "
            f"peak RSS of the whole job {gradients['peak_rss_mb']:.0f} MiB.\n"
        )
    if "combined" in rows:
        row = rows["combined"]
        lines.append(
            f"\nCombined: GFWSVD (K-FAC) at ratio {row['ratio']:g} on the MLP layers, then "
            f"SparseGPT 2:4 on the attention layers ({NSAMPLES_TEXT}): "
            f"{100 * row['params_kept_fraction']:.2f} % of the parameters kept (non-zeros), "
            f"wiki-test {_ppl(row, 'wiki-test')}, lee {_ppl(row, 'lee')}; factorise "
            f"{row['apply_seconds']:.1f} s, SparseGPT {row['sparsegpt_seconds']:.0f} s.\n"
        )
    lines += _end_to_end(rows)
    return "\n".join(lines)


def _end_to_end(rows: dict[str, dict[str, Any]]) -> list[str]:
    """A paragraph for each ``END_TO_END`` row: the job, its cost, its output, its scores."""
    lines = []
    for name, what in END_TO_END.items():
        if name not in rows:
            continue
        row = rows[name]
        ratio = row["compressed_bytes"] / row["expected_bytes"]
        threads = row.get("machine", {}).get("torch_threads")  # a row merged from elsewhere
        lines.append(
            f"\nEnd to end{f', {threads} threads' if threads else ''}: `{row['command']}`: "
            f"{row['wall_seconds']:.0f} s, peak RSS {row['peak_rss_mb']:.0f} MiB ({what} "
            f"included); kept {100 * row['params_kept_fraction']:.2f} %; "
            f"`compressed.safetensors` {row['compressed_bytes']:,} bytes = {ratio:.4f} × the "
            f"fp32 bytes of the factorised layers' factors (the rest is its header); "
            f"perplexity wiki-test {_ppl(row, 'wiki-test')} / lee {_ppl(row, 'lee')}, reloaded "
            f"by `compress-model eval --runtime packed`: {row['reloaded_ppl']['wiki-test']:.2f} "
            f"/ {row['reloaded_ppl']['lee']:.2f}.\n"
        )
    return lines


NSAMPLES_TEXT = "the same 128 calibration windows"
END_TO_END = {  # the end-to-end rows: what their wall time includes
    "cli": "gradient pass on 32 windows",
    "recipe": "gradient pass on 128 windows, block-by-block pass and distillation on 512",
}


VARIANT_MARKERS = {"refit": "^", "sequential": "s", "sequential+refit": "D", "distill": "P",
                   "distill lr 1e-4": "X", "distill lr 3e-4": "v"}  # fmt: skip


def plot(payload: dict[str, Any], results_dir: Path, path: Path) -> None:  # noqa: ARG001
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
    for ax, corpus in zip(axes, CORPORA, strict=True):
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
