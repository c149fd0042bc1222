"""MaskLLM's training curves, ``maskllm_curves.png`` (``plot: maskllm`` in
``benchmarks/tables/maskllm.yaml``): drawn from ``maskllm_curves.json`` (each row's curves, kept
apart from ``maskllm.json`` by the sweep: ``curves: true``) and the copied baselines."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.readers import perplexity, row_name
from benchmarks.render import read_json
from lmcompress.compressor.util.fsutil import atomic_file

CURVES = "maskllm_curves.json"
REFERENCE = "SparseGPT 2:4"  # the copied row the learned masks are measured against
GOAL = 0.9  # the target ratio to it


def plot(payload: dict[str, Any], results_dir: Path, path: Path, corpora: list[str]) -> None:
    """The curves file next to the results, the baselines of ``payload``."""
    found = [b for b in payload["baselines"] if row_name(b) == REFERENCE]
    ref = perplexity(found[0], corpora[0]) if found else None
    plot_curves(read_json(results_dir / CURVES, {}), ref, path)


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


def plot_curves(curves: dict[str, Any], ref: float | None, path: Path) -> None:
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
    blockwise_points = []
    for i, (name, curve) in enumerate(sorted(curves.items())):
        color = colors[i % len(colors)]
        errors = _block_errors(curve)
        if errors:
            if curve.get("ppl") is not None and curve.get("steps"):
                blockwise_points.append((curve["steps"], curve["ppl"], name))
            _draw_block_errors(block_ax, name, errors, color)
        else:
            _draw_end_to_end(hard_ax, loss_ax, curve, name, color)
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
    _label(hard_ax, loss_ax, steps_ax, block_ax)
    _finish(axes, loss_ax)
    fig.tight_layout()
    with atomic_file(path, "wb") as handle:
        fig.savefig(handle, format="png", dpi=100)
    plt.close(fig)


def _draw_block_errors(ax, name: str, errors: list[tuple[int, float, float]], color) -> None:
    xs = [b for b, _, _ in errors]
    ax.plot(xs, [h for _, h, _ in errors], ":", color=color, alpha=0.6)
    ax.plot(
        xs,
        [t for _, _, t in errors],
        "o-",
        color=color,
        markersize=3,
        label=f"{name}: first 5 steps (dotted) → last 5",
    )


def _draw_end_to_end(hard_ax, loss_ax, curve: dict[str, Any], name: str, color) -> None:
    hard = [h for h in curve.get("hard_ppl") or [] if h.get("hard_ppl") is not None]
    if hard:
        hard_ax.plot(_xs(hard), [h["hard_ppl"] for h in hard], "o-", color=color, label=name)
        if curve.get("ppl") is not None:
            hard_ax.plot(_xs(hard)[-1], curve["ppl"], "*", color=color, markersize=12)
    loss = [e for e in curve.get("loss") or [] if isinstance(e, dict) and _loss(e) is not None]
    if loss:
        ys = [_loss(e) for e in loss]
        loss_ax.plot(_xs(loss), ys, "-", color=color, alpha=0.25, linewidth=0.8)
        loss_ax.plot(_xs(loss), _smooth(ys, max(1, len(ys) // 20)), "-", color=color, label=name)


def _label(hard_ax, loss_ax, steps_ax, block_ax) -> None:
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


def _finish(axes, loss_ax) -> None:
    """Log scale where every value is positive (not the loss), grid and legend; "no data" in
    an empty panel."""
    for ax in axes.flat:
        if not ax.get_lines():
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
            continue
        ys = [y for line in ax.get_lines() for y in line.get_ydata()]
        if ys and min(ys) > 0 and ax is not loss_ax:
            ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
