"""The table and the picture of ``benchmarks.subnet_digits``: pure functions of its results JSON."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from benchmarks.render import markdown_table

CHANCE = 0.1


def _values(row: dict[str, Any], key: str) -> list[float]:
    return [run[key] for run in row["seeds"].values()]


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.pstdev(values) if len(values) > 1 else 0.0


def _pct(values: list[float]) -> str:
    mean, std = _mean_std(values)
    return f"{100 * mean:.1f} ± {100 * std:.1f}"


def epochs_to(curve: list[float], fraction: float = 0.9) -> int:
    """The first epoch (1-based) whose val accuracy reaches ``fraction`` of the run's best."""
    goal = fraction * max(curve)
    return next(i + 1 for i, value in enumerate(curve) if value >= goal)


def _label(row: dict[str, Any]) -> str:
    if row["kind"] == "dense":
        return "trained dense (Adam)"
    if row["kind"] == "random":
        where = "paper" if row["target"] is None else f"target {row['target']:g}"
        return f"random subnet ({where} sparsity)"
    where = "paper (logit ≥ 0)" if row["target"] is None else f"target {row['target']:g}"
    return f"extracted, {where}, {'rescale' if row['rescale'] else 'no rescale'}"


def _sparsity(row: dict[str, Any], rows: list[dict[str, Any]]) -> list[float]:
    if row["kind"] == "dense":
        return [0.0]
    if row["kind"] == "random":  # the kept counts of the rescaled extracted row it copies
        twin = next(r for r in rows if r["kind"] == "extracted" and r["target"] == row["target"])
        return _values(twin, "sparsity")
    return _values(row, "sparsity")


def render(payload: dict[str, Any]) -> str:
    hp, split, rows = payload["hyperparameters"], payload["split"], payload["rows"]
    sizes = split["sizes"]
    lines = [
        "# Subnetworks of an untrained MLP on digits (`python -m benchmarks.subnet_digits`)\n",
        f"ASLP (Dupont et al., arXiv 2202.12986) with the library's `subnet` machinery. "
        f"`load_digits` (pixels / 16), stratified {sizes['train']}/{sizes['val']}/"
        f"{sizes['test']} train/val/test split (split seed {split['split_seed']}); MLP "
        f"64→{hp['hidden']}→{hp['hidden']}→10, ReLU, Kaiming-normal fan-in weights, "
        f"U(±1/√fan_in) biases, all frozen at their random values. Masks: keep logits from 0, "
        f"hard Gumbel sample τ {hp['tau']:g} straight-through, `Trainer` SGD lr {hp['lr']:g} "
        f"momentum {hp['momentum']:g} constant, batch {hp['batch_size']}, {hp['epochs']} epochs; "
        f"the per-layer scale (rescale) SGD lr {hp['scale_lr']:g}. Targets: keep-rate "
        f"constraint ({hp['constraint']}, weight {hp['constraint_weight']:g} unless the row "
        f"says otherwise) and top-k extraction. Random subnet: the same kept count per layer "
        f"as the rescaled extracted row, uniformly placed on the same weights; `×1/keep`: "
        f"each layer's kept weights multiplied by 1/keep-rate. Dense: all weights and biases "
        f"trained, Adam lr {hp['dense_lr']:g}, same epochs and batch. Seeds "
        f"{', '.join(map(str, hp['seeds']))} (network init, mask noise, data order); mean ± "
        f"std over seeds. Test accuracy of the extracted model (`extract_layer`, scale folded "
        f"in) at the epoch of best val accuracy of the extracted (hard) subnetwork; `to 90 %`: "
        f"first epoch whose hard-mask val accuracy reaches 90 % of the run's best (mean over "
        f"seeds); `to val ≥ 90 %`: first epoch whose seed-mean val accuracy reaches 90 % "
        f"(`never` if it does not). Chance "
        f"{100 * CHANCE:.0f} %."
        + (" **Quick smoke configuration.**" if payload.get("quick") else "")
        + "\n",
    ]
    header = ["row", "sparsity %", "test acc %", "val acc %", "best epoch", "to 90 % of best",
              "to val ≥ 90 %", "s / run"]  # fmt: skip
    table = []
    for row in rows:
        sparsity = f"{100 * statistics.fmean(_sparsity(row, rows)):.1f}"
        seconds = f"{statistics.fmean(_values(row, 'seconds')):.2f}"
        if row["kind"] == "random":
            table.append([_label(row), sparsity, _pct(_values(row, "test_acc")), "-", "-", "-",
                          "-", seconds])  # fmt: skip
            rescaled = _pct(_values(row, "test_acc_rescaled"))
            table.append([_label(row) + " ×1/keep", sparsity, rescaled, *["-"] * 4, seconds])
            continue
        label = _label(row)
        scaled = row.get("constraint_scale", "relative") == "size"
        if (
            row["kind"] == "extracted"
            and row["target"]
            and (row["constraint"] != hp["constraint"] or scaled)
        ):
            label += f" ({row['constraint']} {row['constraint_weight']:g}"
            label += ", size-scaled)" if scaled else ")"
        curves = _values(row, "val_curve")
        table.append([
            label, sparsity, _pct(_values(row, "test_acc")), _pct(_values(row, "val_acc")),
            f"{statistics.fmean(_values(row, 'best_epoch')):.0f}",
            f"{statistics.fmean(epochs_to(c) for c in curves):.0f}",
            _first_reaching(_curve_mean(row), 0.9), seconds,
        ])  # fmt: skip
    lines.append(markdown_table(header, table))
    if payload.get("note"):
        lines.append(f"\n{payload['note']}\n")
    lines.append(
        f"\nWhole run: {payload['wall_seconds']:.0f} s wall, peak RSS "
        f"{payload['peak_rss_mb']:.0f} MiB (one process; `s / run` is one seed's training and "
        f"extraction), {payload['machine']['torch_threads']} torch thread(s), torch "
        f"{payload['machine']['torch']}.\n"
    )
    return "\n".join(lines)


def _first_reaching(curve: list[float], level: float) -> str:
    return next((str(i + 1) for i, value in enumerate(curve) if value >= level), "never")


def _curve_mean(row: dict[str, Any]) -> list[float]:
    curves = _values(row, "val_curve")
    return [statistics.fmean(values) for values in zip(*curves, strict=True)]


def plot(payload: dict[str, Any], results_dir: Path, path: Path) -> None:  # noqa: ARG001
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hp, rows = payload["hyperparameters"], payload["rows"]
    main = [r for r in rows if r["kind"] == "extracted" and r["constraint"] in
            (hp["constraint"], "none") and r.get("constraint_scale") != "size"]  # fmt: skip
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    for rescale, color in ((True, "C0"), (False, "C1")):
        for paper in (False, True):
            chosen = [r for r in main if r["rescale"] == rescale and (r["target"] is None) == paper]
            if not chosen:
                continue
            xs = [100 * statistics.fmean(_values(r, "sparsity")) for r in chosen]
            stats = [_mean_std(_values(r, "test_acc")) for r in chosen]
            label = f"extracted, {'rescale' if rescale else 'no rescale'}"
            left.errorbar(xs, [100 * m for m, _ in stats], yerr=[100 * s for _, s in stats],
                          color=color, marker="*" if paper else "o", ms=12 if paper else 5,
                          ls="none" if paper else "-", capsize=3,
                          label=label + (" (paper: logit ≥ 0)" if paper else ""))  # fmt: skip
    randoms = [r for r in rows if r["kind"] == "random"]
    randoms.sort(key=lambda r: statistics.fmean(_sparsity(r, rows)))
    xs = [100 * statistics.fmean(_sparsity(r, rows)) for r in randoms]
    for key, style, label in (("test_acc", "s--", "random subnet"),
                              ("test_acc_rescaled", "^:", "random subnet ×1/keep")):  # fmt: skip
        stats = [_mean_std(_values(r, key)) for r in randoms]
        left.errorbar(xs, [100 * m for m, _ in stats], yerr=[100 * s for _, s in stats],
                      fmt=style, color="C2" if key == "test_acc" else "C4", capsize=3,
                      label=label)  # fmt: skip
    dense = next(r for r in rows if r["kind"] == "dense")
    mean, std = _mean_std(_values(dense, "test_acc"))
    left.axhline(100 * mean, color="black", lw=1, label=f"trained dense {100 * mean:.1f} %")
    left.axhline(100 * CHANCE, color="gray", lw=0.8, ls=":", label="chance")
    left.set_xlabel("sparsity % (weights removed)")
    left.set_ylabel(f"test accuracy % (mean ± std, {len(hp['seeds'])} seeds)")
    left.set_title(f"subnetworks of a random MLP 64-{hp['hidden']}-{hp['hidden']}-10, digits")
    left.set_ylim(0, 100)
    left.legend(fontsize=7, loc="lower left")

    picks = [r for r in main if r["target"] in (None, 0.9)]
    for row in picks:
        curve = _curve_mean(row)
        where = "paper" if row["target"] is None else f"target {row['target']:g}"
        right.plot(range(1, len(curve) + 1), [100 * v for v in curve],
                   color="C0" if row["rescale"] else "C1",
                   ls="-" if row["target"] is None else "--",
                   label=f"{where}, {'rescale' if row['rescale'] else 'no rescale'}")  # fmt: skip
    curve = _curve_mean(dense)
    right.plot(range(1, len(curve) + 1), [100 * v for v in curve], color="black", lw=0.8,
               label="trained dense")  # fmt: skip
    right.set_xlabel("epoch")
    right.set_ylabel("val accuracy % of the extracted subnet (seed mean)")
    right.set_title("training curves")
    right.set_ylim(0, 100)
    right.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)
