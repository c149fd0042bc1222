"""Report of the softmax bias: per-layer / per-head magnitudes as JSON, and a layer × head heatmap.

β is reported in probability units and in quantization steps (β / s): a β of 0.3 steps means
the average valid probability lost 0.3 of a step to rounding.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from pathlib import Path

import torch

from lmcompress.compressor.formats.int8_softmax import DEFAULT_SCALE, check_scale
from lmcompress.errors import LmcompressError

logger = logging.getLogger(__name__)


def _natural_key(name: str) -> list:
    """``layers.10`` after ``layers.9``: digit runs compare as numbers."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def bias_magnitudes(
    bias: Mapping[str, torch.Tensor], scale: float = DEFAULT_SCALE
) -> dict[str, object]:
    """A JSON-able summary of β per layer (in model order) and per head, if β is per head."""
    scale = check_scale(scale)
    layers = []
    for name in sorted(bias, key=_natural_key):
        beta = bias[name].detach().double().cpu().reshape(-1)  # (H,) or (1,)
        layers.append(
            {
                "name": name,
                "mean": beta.mean().item(),
                "mean_abs": beta.abs().mean().item(),
                "max_abs": beta.abs().max().item(),
                "mean_steps": beta.mean().item() / scale,
                "per_head": beta.tolist(),
                "per_head_steps": (beta / scale).tolist(),
            }
        )
    overall = torch.cat([torch.tensor(entry["per_head"]) for entry in layers]) if layers else None
    return {
        "scale": scale,
        "granularity": "head" if layers and len(layers[0]["per_head"]) > 1 else "layer",
        "mean_abs": overall.abs().mean().item() if overall is not None else 0.0,
        "max_abs": overall.abs().max().item() if overall is not None else 0.0,
        "layers": layers,
    }


def plot_bias_heatmap(
    bias: Mapping[str, torch.Tensor],
    path: str | Path,
    scale: float = DEFAULT_SCALE,
    title: str = "softmax bias β (quantization steps)",
) -> Path:
    """Write a layer × head heatmap of β / s to ``path`` (PNG); returns the path.

    Per-layer β (one value a layer) gives a single column. Needs matplotlib (a dev extra).
    """
    scale = check_scale(scale)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise LmcompressError("the bias heatmap needs matplotlib: pip install matplotlib") from err
    names = sorted(bias, key=_natural_key)
    if not names:
        raise LmcompressError("no softmax bias to plot")
    rows = [bias[n].detach().double().cpu().reshape(-1) / scale for n in names]
    width = max(r.numel() for r in rows)
    grid = torch.full((len(rows), width), float("nan"), dtype=torch.float64)
    for i, row in enumerate(rows):
        grid[i, : row.numel()] = row
    fig, ax = plt.subplots(figsize=(1.2 + 0.45 * width, 1.2 + 0.3 * len(rows)))
    try:
        image = ax.imshow(grid.numpy(), aspect="auto", cmap="viridis", interpolation="nearest")
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_xticks(range(width))
        ax.set_yticks(range(len(rows)))
        ax.set_title(title, fontsize=9)
        fig.colorbar(image, ax=ax, label="β / s")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120, bbox_inches="tight")
    finally:
        plt.close(fig)
    logger.info("softmax bias heatmap written to %s", path)
    return path
