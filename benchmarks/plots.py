"""The plots a table may draw (``plot:`` in ``benchmarks/tables/NAME.yaml``), one fixed list:
each ``(payload, results_dir, path, corpora)`` -> ``NAME_curves.png`` at ``path`` (and any other
PNG beside it). matplotlib (and torch, for a heatmap of tensors) are imported only to draw."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.columns import perplexity

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


PLOTS: dict[str, Callable[[Record, Path, Path, list[str]], None]] = {"int8": int8}
