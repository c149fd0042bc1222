"""The one renderer of every benchmark: a results JSON file is the record, and its markdown table
(and PNG, where a benchmark has curves) is a pure function of it.

Each benchmark module gives ``NAME`` (its results are ``results/NAME.{json,md}``) and
``render(payload) -> str``; one with curves also gives ``plot(payload, results_dir, path)``.
``--render-only`` (``benchmarks.harness``) redraws the md (and PNG) from the committed JSON
without running anything, and ``tests/benchmarks/test_render.py`` checks that this reproduces
the committed files byte for byte. ``--only`` reruns some rows and merges them into the results
file (``merge_rows``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from lmcompress.compressor.util.fsutil import atomic_file

log = logging.getLogger(__name__)

RESULTS_DIR = Path(__file__).resolve().parent / "results"

Render = Callable[[dict[str, Any]], str]
Plot = Callable[[dict[str, Any], Path, Path], None]  # (payload, results dir, png path)


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def dig(data: Any, *keys: str) -> Any:
    """``data[k1][k2]...``, or None where a key is missing or a level is not a dict."""
    for key in keys:
        if not isinstance(data, dict) or key not in data:
            return None
        data = data[key]
    return data


def read_json(path: Path, default: Any = None) -> Any:
    return json.loads(path.read_text()) if path.is_file() else default


def write_json(path: Path, payload: Any, indent: int = 2) -> None:
    with atomic_file(path) as handle:
        handle.write(json.dumps(payload, indent=indent) + "\n")


def merge_rows(
    old: Iterable[dict], new: Iterable[dict], key: Callable[[dict], str], order: Sequence[str]
) -> list[dict]:
    """``old`` with every row whose ``key`` is in ``new`` replaced; sorted as the job table
    (``order``), rows of jobs no longer in the table last, by key."""
    rows = {key(r): r for r in old}
    rows.update({key(r): r for r in new})
    rank = {name: i for i, name in enumerate(order)}
    return sorted(rows.values(), key=lambda r: (rank.get(key(r), len(rank)), key(r)))


def write_results(
    results_dir: Path, name: str, payload: dict[str, Any], render: Render, plot: Plot | None = None
) -> str:
    """Write ``NAME.json`` (the record), then draw ``NAME.md`` (and the PNG) from it; the md."""
    write_json(results_dir / f"{name}.json", payload)
    return render_files(results_dir, name, render, plot)


def render_files(results_dir: Path, name: str, render: Render, plot: Plot | None = None) -> str:
    """``--render-only``: redraw ``NAME.md`` (and ``NAME_curves.png``) from ``NAME.json``."""
    payload = read_json(results_dir / f"{name}.json")
    if payload is None:
        raise FileNotFoundError(f"{results_dir / name}.json: nothing to render")
    table = render(payload)
    with atomic_file(results_dir / f"{name}.md") as handle:
        handle.write(table)
    if plot is not None:
        plot(payload, results_dir, results_dir / f"{name}_curves.png")
    return table
