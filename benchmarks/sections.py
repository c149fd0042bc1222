"""Sections of a table drawn by code rather than columns (``render:`` of a section in
``benchmarks/tables/NAME.yaml``), one fixed list: each ``(its rows, context)`` -> ``(header,
lines, text after the table)``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from benchmarks.columns import Context, counts_text, estimate_ratio, row_name, within

Record = dict[str, Any]
Lines = tuple[list[str], list[list[Any]], str]


def int8_interop(rows: list[Record], context: Context) -> Lines:
    """The int8_interop row, a line per corpus: plain transformers' perplexity, our simulation
    of compressed-tensors' scheme, their relative difference, and our runtime's."""
    interop = rows[0]
    lines = [
        [
            c,
            f"{interop['transformers'][c]:.3f}",
            f"{interop['simulated'][c]:.3f}",
            f"{abs(interop['transformers'][c] / interop['simulated'][c] - 1):.1e}",
            f"{interop['runtime'][c]:.3f}",
        ]
        for c in context.corpora
    ]
    header = ["corpus", "transformers ppl", "simulated ppl", "relative diff", "our runtime"]
    return header, lines, ""


def memory_grid(rows: list[Record], context: Context) -> Lines:
    """Rows named ``GROUP FAMILY: METHOD`` as a grid, a line per method and a column per family:
    estimate / peak (✗ outside the factor, † where it predates counting text); then which rows
    of the whole table lie outside the factor."""
    factor = context.settings.get("factor", 1.5)
    cells = {tuple(row_name(r).split(": ")): r for r in rows}
    families = list(dict.fromkeys(key[0] for key in cells))
    methods = list(dict.fromkeys(key[1] for key in cells))
    lines = []
    for method in methods:
        shown = []
        for family in families:
            r = cells.get((family, method))
            shown.append(
                ""
                if r is None
                else f"{estimate_ratio(r):.2f}"
                + ("" if within(r, factor) else " ✗")
                + ("" if counts_text(r) else " †")
            )
        lines.append([method, *shown])
    every = list(context.rows.values())
    outside = [row_name(r) for r in every if not within(r, factor)]
    text = f"\nOutside the factor: {', '.join(outside) if outside else 'none'}.\n"
    if any(not counts_text(r) for r in every):
        text += (
            "\n†: run before the estimate counted tokenizing the corpora (the job read a "
            "corpus but its estimate has no part for it); rerun the row to update it.\n"
        )
    header = ["method", *(family.split(" ", 1)[-1] for family in families)]
    return header, lines, text


SECTIONS: dict[str, Callable[[list[Record], Context], Lines]] = {
    "int8_interop": int8_interop,
    "memory_grid": memory_grid,
}
