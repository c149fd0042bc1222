"""``report.png``: what an export did, per layer, and what it cost in perplexity.

One row of panels, each drawn only if the report has its numbers: per-layer sparsity, rank
(as a fraction of full rank), relative error (weight, output or quantization error, as the
method measured it), each against the decoder block the layer sits in with one line per kind
of layer (``q_proj``, ``down_proj``, ...); then perplexity dense vs compressed per corpus.

matplotlib is imported here only, when a report is drawn, and draws through its Agg canvas on
a figure of its own: nothing touches pyplot's global state or the user's backend.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path
from typing import Any

_BLOCK = re.compile(r"\.(\d+)\.")


def _per_layer_panels(layers: list[dict[str, Any]]) -> list[tuple[str, str, Any]]:
    """``(title, y label, value of a layer or None)`` for each quantity the report has."""
    quantized = any(layer.get("bits") is not None for layer in layers)
    kinds = sorted({layer.get("error_kind", "weight") for layer in layers})
    error_title = "quantization error" if quantized else "relative error"
    candidates = [
        ("sparsity", "fraction of weights zero", lambda x: x.get("sparsity")),
        (
            "rank",
            "rank / full rank",
            lambda x: x["rank"] / min(x["shape"]) if x.get("rank") is not None else None,
        ),
        (error_title, f"relative {'/'.join(kinds)} error", lambda x: x.get("rel_error")),
    ]
    return [c for c in candidates if any(c[2](layer) is not None for layer in layers)]


def _block_of(name: str, ordinal: int) -> int:
    match = _BLOCK.search(name)
    return int(match.group(1)) if match else ordinal


def write_report_png(manifest: dict[str, Any], path: str | Path) -> None:
    """Draw the report of ``manifest`` (``compression.json``'s content) into ``path``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    layers = manifest["report"]["layers"]
    panels = _per_layer_panels(layers)
    fig = Figure(figsize=(4.4 * (len(panels) + 1), 3.9), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels) + 1, squeeze=False)[0]

    by_kind: dict[str, list[tuple[int, dict[str, Any]]]] = defaultdict(list)
    for ordinal, layer in enumerate(layers):
        by_kind[layer["name"].rsplit(".", 1)[-1]].append((_block_of(layer["name"], ordinal), layer))
    colors = {kind: f"C{i % 10}" for i, kind in enumerate(by_kind)}  # one colour per kind
    handles: dict[str, Any] = {}  # kind -> a line of it, for one legend over every panel
    for ax, (title, ylabel, value) in zip(axes, panels, strict=False):
        for kind, members in by_kind.items():
            points = [(block, value(layer)) for block, layer in members]
            points = [(b, v) for b, v in points if v is not None]
            if points:
                xs, ys = zip(*sorted(points), strict=True)
                (line,) = ax.plot(xs, ys, marker="o", markersize=3, linewidth=1, color=colors[kind])
                handles.setdefault(kind, line)
        ax.set_title(title)
        ax.set_xlabel("decoder block")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if title in ("sparsity", "rank"):
            ax.set_ylim(0, 1.05)
    if len(handles) > 1:
        kinds = [kind for kind in by_kind if kind in handles]
        axes[0].legend([handles[k] for k in kinds], kinds, fontsize=7, ncol=2)
    _perplexity_panel(axes[-1], manifest.get("results") or {})

    results = manifest.get("results") or {}
    where = f" on {results['checkpoint']}" if results.get("checkpoint") else ""
    fig.suptitle(f"{manifest['method']}{where}: {len(layers)} layers compressed")
    fig.savefig(path)


def _perplexity_panel(ax: Any, results: dict[str, Any]) -> None:
    compressed = results.get("compressed") or {}
    dense = results.get("dense") or {}
    ax.set_title("perplexity (lower is better)")
    if not compressed:
        ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)
        ax.set_xticks([])
        ax.set_yticks([])
        return
    corpora = list(compressed)
    stages = results.get("stages") or []  # a multi-stage recipe: a bar after each stage
    sources = [("dense", dense, "0.6")]
    sources += [
        (f"after {s['method']}", s.get("compressed") or {}, f"C{i}")
        for i, s in enumerate(stages[:-1])
    ]
    sources.append(("compressed", compressed, "tab:red"))
    width = 0.76 / len(sources)
    for offset, (label, source, color) in enumerate(sources):
        shift = (offset - (len(sources) - 1) / 2) * width
        xs = [i + shift for i, corpus in enumerate(corpora) if corpus in source]
        ys = [source[c]["perplexity"] for c in corpora if c in source]
        if not ys:
            continue
        bars = ax.bar(xs, ys, width, label=label, color=color)
        texts = [f"{y:.2f}" for y in ys]
        if source is not dense:  # the change against dense, where dense was scored
            base = [dense.get(c, {}).get("perplexity") for c in corpora if c in source]
            texts = [
                f"{t}\n({y / b - 1:+.1%})" if b else t
                for t, y, b in zip(texts, ys, base, strict=True)
            ]
        ax.bar_label(bars, labels=texts, fontsize=8 if len(sources) < 3 else 6)
    ax.set_xticks(range(len(corpora)), [Path(c).name for c in corpora], fontsize=8)
    ax.set_xlim(-0.8, len(corpora) - 0.2)  # one corpus: bars of the same width as several
    values = [r["perplexity"] for _, source, _ in sources for r in source.values()]
    log = max(values) / max(min(values), 1e-9) > 20  # a 50x gap hides the dense bars
    if log:
        ax.set_yscale("log")
    ax.set_ylabel("token perplexity" + (" (log scale)" if log else ""))
    ax.margins(y=0.15)
    ax.legend(fontsize=8)
