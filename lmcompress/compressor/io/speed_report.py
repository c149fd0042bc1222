"""The speed record (:func:`lmcompress.evaluation.speed.bench`) as a person reads it: a markdown
table, the JSON, and a PNG (prefill and decode throughput per row against the best dense row).

Pure rendering of plain dicts, in the core's ``io`` beside the model card that shows the same
table: the measurement (above the core) hands its record down, nothing here measures."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lmcompress.errors import printable

SPEED_JSON, SPEED_MD, SPEED_PNG = "speed.json", "speed.md", "speed.png"


def _ratio(value: float | None) -> str:
    return f"{value:.2f}" if value is not None else "-"


def speed_table(record: dict[str, Any]) -> str:
    """The markdown table of a speed record, with the host and the settings above it."""
    host, options = record["host"], record["options"]
    batch, tokens = options["prefill"]
    bandwidth = record.get("bandwidth_bytes_per_s")
    isa = ", ".join(host.get("isa") or []) or "no listed ISA"
    cpu = printable(host.get("cpu_model"))
    where = f"Host: {cpu} ({isa}), {host.get('torch_threads')} threads, "
    where += f"device {options['device']}, torch {host.get('torch')}"
    if bandwidth:
        where += f"; memory read bandwidth {bandwidth / 1e9:.1f} GB/s"
    lines = [
        where + ".",
        "",
        f"Prefill {batch} × {tokens} tokens; decode {options['decode']} new tokens at batch 1 "
        f"after a {options['prompt']}-token prompt (greedy, KV cache); median of "
        f"{options['repeats']} interleaved rounds after {options['warmup']} warm-up.",
        "",
        "| model | dtype | prefill tok/s | × best dense | decode tok/s | × best dense "
        "| decode % of limit | TTFT ms | weights MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in record["rows"]:
        fraction = row.get("decode_fraction_of_limit")
        lines.append(
            f"| {printable(row['name'])} | {row['dtype']} | {row['prefill_tokens_per_s']:,.0f} "
            f"| {_ratio(row['prefill_vs_best_dense'])} | {row['decode_tokens_per_s']:.1f} "
            f"| {_ratio(row['decode_vs_best_dense'])} "
            f"| {f'{fraction:.0%}' if fraction is not None else '-'} "
            f"| {row['ttft_s'] * 1e3:.0f} | {row['weight_bytes'] / 2**20:.1f} |"
        )
    return "\n".join(lines) + "\n"


def write_speed(record: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """``speed.json``, ``speed.md`` and ``speed.png`` in ``out_dir`` (created)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / SPEED_JSON).write_text(json.dumps(record, indent=2) + "\n")
    (out_dir / SPEED_MD).write_text(speed_table(record))
    plot_speed(record, out_dir / SPEED_PNG)
    return [out_dir / name for name in (SPEED_JSON, SPEED_MD, SPEED_PNG)]


def plot_speed(record: dict[str, Any], path: Path) -> None:
    """Two panels of horizontal bars: prefill and decode, × the best dense row."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = record["rows"]
    names = [f"{r['name']} ({r['dtype']})" for r in rows]
    figure = Figure(figsize=(10, 0.5 * len(rows) + 1.5))
    FigureCanvasAgg(figure)
    panels = (("prefill_vs_best_dense", "prefill"), ("decode_vs_best_dense", "decode, batch 1"))
    for index, (key, title) in enumerate(panels):
        ax = figure.add_subplot(1, 2, index + 1)
        values = [r[key] or 0.0 for r in rows]
        ax.barh(range(len(rows)), values, color=["C0" if v >= 1 else "C3" for v in values])
        ax.axvline(1.0, color="k", linewidth=0.8)
        ax.set_yticks(range(len(rows)), names if index == 0 else [""] * len(rows))
        ax.invert_yaxis()
        ax.set_xlabel("tokens/s ÷ best dense row")
        ax.set_title(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
