"""What a results row holds, read the same way by the columns, the plots and the row kinds: its
name and its perplexities, in the layouts written before the tables too (``magnitude.json``:
each corpus at the top of the row; ``recipes.json``: ``compressed`` and ``dense`` as bare
numbers; ``pruning.json``: no names; ``maskllm.json``: ``ppl`` a bare number)."""

from __future__ import annotations

from typing import Any

Record = dict[str, Any]


def row_name(row: Record) -> str:
    """A row's name (``pruning.json``'s rows, written before names, are TOOL:METHOD:SPARSITY)."""
    if "name" in row:
        return row["name"]
    if row["method"] == "dense":
        return "dense"
    return f"{row['tool']}:{row['method']}:{row['sparsity']}"


def scored(row: Record, corpus: str, which: str = "ppl") -> Any:
    """The evaluation of ``corpus`` (``which``: ``ppl`` the compressed model, ``dense``); a bare
    number under ``which`` is of the row's one corpus (``maskllm.json``: named by ``corpus``)."""
    found = row.get(which, {})
    if isinstance(found, (int, float)):
        return found if row.get("corpus", corpus) == corpus else None
    found = found.get(corpus)
    if found is None and which == "ppl":  # the layouts written before the tables
        found = row[corpus] if corpus in row else row.get("compressed", {}).get(corpus)
    return found


def perplexity(row: Record, corpus: str, which: str = "ppl") -> float | None:
    found = scored(row, corpus, which)
    return found["perplexity"] if isinstance(found, dict) else found


def number(value: Any, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
