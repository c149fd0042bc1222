"""The columns of the learned-mask tables (``tables/subnet.yaml``, ``tables/learned.yaml``), in
``benchmarks.columns``' registries:

- ``source``: where a copied row comes from (``this script``: the table's own);
  ``block_before``, ``block_after``, ``block_ratio``: a learned mask's hard-mask block-output
  error, mean over the blocks, before training (the prior's mask) and after, and the blocks'
  mean ratio of the two;
- ``tokens``: the training tokens; ``tokens_per_s``: those over the training seconds;
  ``threads``: the row's ``OMP_NUM_THREADS`` (``all``: unset);
- ``vs_sparsegpt:CORPUS``: the perplexity over SparseGPT's at the same sparsity (a SparseGPT
  row of the table's own, else a copied one; ``-`` for the dense row);
- ``vs_baseline:CORPUS,CORPUS``: each corpus's perplexity over the row's baseline's (``/``
  between): its ``baseline:`` in the table (then named), else the first one-stage SparseGPT row
  of its sparsity that names none; ``(other threads)`` where the two ran on other thread counts;
- ``grouped:FIELD``: the row's FIELD, digits grouped by thousands (0 digits);
- ``origin``: ``baseline (FILE)`` for a copied row, else ``METHOD (this script)``;
  ``train_tokens``: the training tokens (a copied row's: its calibration tokens); ``hard_span``:
  the held-out hard-mask perplexity at step 0 (the prior's mask) and at the last step; ``args``:
  the row's options as flags (``one-shot`` for a copied row);
- the caption variables ``machine``: the CPU, cores, ISA and torch of the results file's host;
  ``reference_ppl``: the copied ``SparseGPT 2:4`` row's perplexity on the first corpus.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from benchmarks.readers import Record, number, perplexity, row_name

if TYPE_CHECKING:
    from benchmarks.columns import Cell, Context


def _blocks(row: Record) -> list[Record]:
    return [b for b in row.get("block_hard", []) if b.get("hard_after") is not None]


def _block_mean(field: str) -> Callable[[Record, int], str]:
    def value(row: Record, digits: int) -> str:
        blocks = _blocks(row)
        return number(sum(b[field] for b in blocks) / len(blocks) if blocks else None, digits)

    return value


def _block_ratio(row: Record, digits: int) -> str:
    ratios = [b["hard_after"] / b["hard_before"] for b in _blocks(row)]
    return number(sum(ratios) / len(ratios) if ratios else None, digits)


def _grouped(value: Any, digits: int) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _tokens_per_s(row: Record, digits: int) -> str:
    tokens, seconds = row.get("tokens"), row.get("train_seconds")
    return _grouped(tokens / seconds if tokens and seconds else None, digits)


def _vs_sparsegpt(corpus: str, digits: int) -> Cell:
    """The perplexity over SparseGPT's at the row's sparsity: the last SparseGPT row of the
    table's own (rerun under the same conditions), else a copied one (``source``)."""

    def cell(row: Record, context: Context) -> str:
        same = [
            r
            for r in context.rows.values()
            if r.get("method") == "sparsegpt" and r.get("sparsity") == row.get("sparsity")
        ]
        ref = ([r for r in same if "source" not in r] or same or [None])[-1]
        value = perplexity(row, corpus)
        if ref is None or not value or row.get("method") == "dense":
            return "-"
        return f"{value / perplexity(ref, corpus):.{digits}f}"

    return cell


def _one_stage_sparsegpt(row: Record, context: Context) -> Record | None:
    return next(
        (
            r
            for r in context.rows.values()
            if [s.get("method") for s in r.get("stages", [])] == ["sparsegpt"]
            and r.get("sparsity") == row.get("sparsity")
            and row_name(r) not in context.baselines
        ),
        None,
    )


def _vs_baseline(arg: str, digits: int) -> Cell:
    corpora = arg.split(",")

    def cell(row: Record, context: Context) -> str:
        named = None if "stage" in row else context.baseline(row)  # a stage: float, ÷ float
        ref = named or _one_stage_sparsegpt(row, context)
        values = [perplexity(row, c) for c in corpora]
        if ref is None or row_name(ref) == row_name(row) or not all(values):
            return "-"
        pairs = zip(values, corpora, strict=True)
        text = " / ".join(f"{v / perplexity(ref, c):.{digits}f}" for v, c in pairs)
        if named:
            text += f" (÷ {row_name(named)})"
        if "stage" not in row and ref.get("threads") != row.get("threads"):
            text += " (other threads)"
        return text

    return cell


def _origin(row: Record, _digits: int) -> str:
    if "source" in row:
        return f"baseline ({row['source']})"
    return f"{row.get('method') or 'maskllm'} (this script)"


def _train_tokens(row: Record, _digits: int) -> str:
    tokens = row.get("tokens")
    if "source" in row and tokens:  # a copied one-shot row: its calibration tokens
        return f"{tokens:,} (calib)"
    return "-" if tokens is None else f"{tokens:,}"


def _hard_span(row: Record, _digits: int) -> str:
    hard = [p["hard_ppl"] for p in row.get("hard_ppl", []) if p.get("hard_ppl") is not None]
    first = row.get("prior_hard_ppl", next((p["hard_ppl"] for p in row.get("hard_ppl", [])
                                            if p.get("step") == 0), None))  # fmt: skip
    last = row.get("final_hard_ppl", hard[-1] if hard else None)
    return " → ".join(f"{v:.2f}" for v in (first, last) if v) or "-"


def _args(row: Record, _digits: int) -> str:
    return "one-shot" if "source" in row else "`" + " ".join(row.get("args", [])) + "`"


def _reference_ppl(payload: Record, settings: Mapping[str, Any]) -> str:
    """The first corpus's perplexity of the copied row ``SparseGPT 2:4`` (the reference)."""
    found = [r for r in payload.get("baselines", []) if row_name(r) == "SparseGPT 2:4"]
    return number(perplexity(found[0], settings["corpora"][0]) if found else None, 2)


def _machine(payload: Record, _settings: Mapping[str, Any]) -> str:
    host = payload.get("machine", {})
    isa = ", ".join(host.get("isa", []) or ["no AVX-512 VNNI/BF16 or AMX"])
    cores = f"{host.get('cpu_count', '?')} cores"
    return f"{host.get('cpu_model', '?')} ({cores}; {isa}); torch {host.get('torch', '?')}"


# key -> (header, value(row, digits), default digits, shown in stage rows): columns.FIXED's
LEARNED_FIXED: dict[str, tuple[str, Callable[[Record, int], Any], int, bool]] = {
    "source": ("source", lambda row, _digits: row.get("source", "this script"), 0, False),
    "block_before": ("block error before", _block_mean("hard_before"), 4, False),
    "block_after": ("after", _block_mean("hard_after"), 4, False),
    "block_ratio": ("after ÷ before", _block_ratio, 3, False),
    "tokens": ("tokens", lambda row, _digits: f"{row.get('tokens') or 0:,}", 0, False),
    "tokens_per_s": ("tokens/s", _tokens_per_s, 1, False),
    "threads": ("threads", lambda row, _digits: row.get("threads") or "all", 0, False),
    "origin": ("source", _origin, 0, False),
    "train_tokens": ("train tokens", _train_tokens, 0, False),
    "hard_span": ("hard ppl step 0 → last", _hard_span, 2, False),
    "args": ("args", _args, 0, False),
}
# family:ARG -> (header, (arg, digits) -> cell, default digits): columns.FAMILIES'
LEARNED_FAMILIES: dict[str, tuple[str, Callable[[str, int], Cell], int]] = {
    "vs_sparsegpt": ("÷ SparseGPT", _vs_sparsegpt, 3),
    "vs_baseline": ("÷ baseline", _vs_baseline, 3),
    "grouped": ("{}", lambda field, digits: lambda row, _c: _grouped(row.get(field), digits), 0),
}
LEARNED_CAPTION_VARIABLES = {"machine": _machine, "reference_ppl": _reference_ppl}
