"""The plots a table may draw (``plot:`` in ``benchmarks/tables/NAME.yaml``), one fixed list:
each ``(payload, results_dir, path, corpora)`` -> ``NAME_curves.png`` at ``path`` (and any other
PNG beside it). matplotlib (and torch, for a heatmap of tensors) are imported only to draw."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import lowrank_rows, maskllm_plot
from benchmarks.readers import perplexity

Record = dict[str, Any]


def int8(payload: Record, results_dir: Path, path: Path, corpora: list[str]) -> None:
    """Each row's perplexity per corpus (the dense model's as a line), and the per-head softmax
    bias β of the ``+ bias correction per head`` row, layer × head (``int8_bias_heads.png``)."""
    # Only the PNG needs these; the heatmap takes torch tensors (tests/benchmarks/test_layout.py)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch

    from lmcompress.methods.int8.bias_plot import plot_bias_heatmap

    rows = [r for r in payload["results"] if r["name"] != "interop"]
    head = next((r for r in rows if r["name"] == "+ bias correction per head"), None)
    fig, axes = plt.subplots(1, len(corpora), figsize=(12, 4))
    for ax, corpus in zip(axes, corpora, strict=True):
        names = [r["name"] for r in rows]
        ax.barh(names, [perplexity(r, corpus) for r in rows], color="tab:blue")
        dense = rows[0].get("dense") if rows else None
        if dense:
            ax.axvline(
                perplexity(rows[0], corpus, "dense"), color="black", linestyle="--", label="fp32"
            )
            ax.legend()
        ax.set_xlabel(f"{corpus} perplexity")
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    if head and head.get("softmax", {}).get("bias"):
        bias = head["softmax"]["bias"]
        tensors = {layer["name"]: torch.tensor(layer["per_head"]) for layer in bias["layers"]}
        plot_bias_heatmap(tensors, results_dir / "int8_bias_heads.png", scale=bias["scale"])


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def subnet(payload: Record, _results_dir: Path, path: Path, corpora: list[str]) -> None:
    """Per sparsity (50 %, 2:4), each row's perplexity on every corpus as bars (the copied
    one-shot rows first; the ablations, on the first blocks only, left out)."""
    plt = _pyplot()
    rows = [*payload.get("baselines", []), *payload["results"]]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, sparsity in zip(axes, ("0.5", "2:4"), strict=True):
        chosen = [
            r
            for r in rows
            if r["sparsity"] == sparsity
            and r["ppl"].get(corpora[0])
            and not r["name"].startswith("ablation: ")
        ]
        x = range(len(chosen))
        for offset, corpus in zip((-0.2, 0.2), corpora, strict=True):
            ax.bar([i + offset for i in x], [perplexity(r, corpus) or 0 for r in chosen], 0.4,
                   label=corpus)  # fmt: skip
        ax.set_xticks(list(x), [r["name"] for r in chosen], rotation=35, ha="right", fontsize=7)
        ax.set_ylabel("perplexity")
        ax.set_title(f"sparsity {sparsity}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def learned(payload: Record, _results_dir: Path, path: Path, corpora: list[str]) -> None:
    """Left: the held-out hard-mask perplexity during training against the training tokens (a
    line a stage, a colour a row); right: each row's perplexity per corpus against its tokens."""
    plt = _pyplot()
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
    for corpus, marker in zip(corpora, ("o", "s"), strict=True):
        for row in rows:
            if perplexity(row, corpus):
                right.scatter(row.get("tokens") or 0, perplexity(row, corpus), marker=marker)
                right.annotate(f"{row['name']} ({corpus})", (row.get("tokens") or 0,
                               perplexity(row, corpus)), fontsize=6)  # fmt: skip
    right.set_xlabel("training tokens")
    right.set_ylabel("perplexity (o wiki-test, s lee)")
    right.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def structured(payload: Record, _results_dir: Path, path: Path, corpora: list[str]) -> None:
    """Per corpus, perplexity against the decoder parameters kept: a line per family of rows
    (the row's name without its ratio: width, depth, svd, learned, and their distilled points),
    the dense model's as a dashed line."""
    plt = _pyplot()
    rows = [r for r in payload["results"] if r.get("summary")]
    dense = next((r for r in payload["results"] if r["name"] == "dense"), None)
    fig, axes = plt.subplots(1, len(corpora), figsize=(6 * len(corpora), 4.5), squeeze=False)
    for ax, corpus in zip(axes[0], corpora, strict=True):
        families: dict[str, list[tuple[float, float]]] = {}
        for row in rows:
            family = " ".join(w for w in row["name"].split() if not w[:1].isdigit())
            summary, ppl = row["summary"], perplexity(row, corpus)
            if ppl:
                kept = summary["params_kept"] / summary["params_compressed_layers"]
                families.setdefault(family, []).append((kept, ppl))
        for family, points in families.items():
            points.sort()
            ax.plot(*zip(*points, strict=True), marker="o", label=family)
        if dense and perplexity(dense, corpus):
            ax.axhline(perplexity(dense, corpus), color="black", linestyle="--", label="dense")
        ax.set_xlabel("decoder linears' parameters kept")
        ax.set_ylabel(f"{corpus} perplexity")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


PLOTS: dict[str, Callable[[Record, Path, Path, list[str]], None]] = {
    "structured": structured,
    "int8": int8,
    "subnet": subnet,
    "learned": learned,
    "maskllm": maskllm_plot.plot,
    "lowrank": lowrank_rows.plot,
}
