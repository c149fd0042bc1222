"""The footers a table may end with (``notes:`` in ``benchmarks/tables/NAME.yaml``), one fixed
list: each ``(payload, rows)`` -> the text after the tables, ``rows`` the records of the main
table's lines (the copied rows not among them)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from benchmarks.lowrank_rows import paragraphs

Record = dict[str, Any]


def as_flags(options: Record) -> list[str]:
    """A recipe's options as the flags that give them (``{blockwise: true, tau: [4, 0.05]}`` ->
    ``--blockwise --tau 4 0.05``), what a note shows of a row."""
    flags = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            flags += [flag, *map(str, value if isinstance(value, list) else [value])]
    return flags


def subnet(payload: Record, rows: list[Record]) -> str:
    """A line a row: its note, its options as flags, when it ran; then the file's own note."""
    lines = [
        f"- **{r['name']}**: {r['note']} (`{' '.join(r['args'])}`) [run {r['finished']}]"
        for r in rows
    ]
    if payload.get("note"):
        lines += ["", payload["note"]]
    return "\n\n" + "\n".join(lines) + "\n"


def learned(_payload: Record, rows: list[Record]) -> str:
    """A line a row: its note, when it ran, which stages were reused; then the command of each
    stage (and the recipe it ran, where it ran one: ``--config``)."""
    lines = []
    for row in rows:
        reused = [str(i) for i, stage in enumerate(row["stages"], 1) if stage.get("reused")]
        again = f"; stage {', '.join(reused)} reused from an identical run" if reused else ""
        lines.append(f"- **{row['name']}**: {row['note']} [run {row['finished']}{again}]")
        recipes = row.get("recipes") or [None] * len(row["commands"])
        for command, recipe in zip(row["commands"], recipes, strict=True):
            ran = f" with `{json.dumps(recipe)}`" if recipe else ""
            lines.append(f"  - `compress-model {' '.join(command)}`{ran}")
    return "\n\n" + "\n".join(lines) + "\n"


def maskllm(payload: Record, rows: list[Record]) -> str:
    """A line a row: its note, the settings it ran with where they differ from the file's, when
    it ran."""
    settings, lines = payload.get("settings", {}), []
    for row in rows:
        line = f"- **{row['name']}**: {row.get('note') or '-'}"
        ran = row.get("settings") or {}
        differ = {k: v for k, v in ran.items() if settings.get(k) not in (None, v)}
        if differ:
            line += f" (run with different settings: {differ})"
        if row.get("finished"):
            line += f" [run {row['finished']}]"
        lines.append(line)
    return "\n" + "\n".join(lines) + "\n" if lines else ""


NOTES: dict[str, Callable[[Record, list[Record]], str]] = {
    "subnet": subnet,
    "learned": learned,
    "maskllm": maskllm,
    "lowrank": paragraphs,
}
