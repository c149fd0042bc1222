"""The columns a table may show (``columns:`` in ``benchmarks/tables/NAME.yaml``), one fixed list:
each a header and a cell, a function of the row's record and the table around it.

A column is named by its key (``ppl:wiki-test``), or by a mapping that also gives its
``header`` or its ``digits`` (``{column: ppl:wiki-test, digits: 3}``). Keys:

- ``name``, ``method``, ``sparsity``, ``tool``: what the row is;
- ``ppl:CORPUS``: the compressed model's perplexity on CORPUS (2 digits); ``dense_ppl:CORPUS``
  the dense model's as the row's job scored it;
- ``params_kept``: of the compressed layers; ``command``: the row's command line;
- ``runtime``, ``reload_ppl:CORPUS``, ``reload_mib``, ``reload_ratio``, ``reload_rss_mib``,
  ``reload_process_rss_mib``: with the ``reload`` setting, a line per runtime the output is
  reloaded in: its perplexity, the compressed layers' bytes after loading (and over their
  dense fp16 bytes), the peak RSS right after loading and of the whole eval process;
- ``wall_s``, ``peak_rss_mib``: of the row's compression process (``-`` where not measured);
- ``ratio:ppl:CORPUS``, ``ratio:wall_s``, ``ratio:peak_rss_mib``: divided by the row's
  baseline (``baseline:`` of the row, else of the table; ``-`` without one), or by the row a
  ``{column: ratio:..., over: NAME}`` names (a copied one too; that row's own ratio is 1);
- ``formats``: the stored formats of the compressed layers;
- ``layers_mib``, ``layers_ratio``: the compressed layers' stored bytes (values and metadata,
  as the report counts them), and the same over their dense fp32 bytes;
- ``file_mib``: the size of ``compressed.safetensors``;
- ``vs_dense``: the perplexity's change from the dense model's (as the table's baseline row
  scored it), per corpus; ``beta``: the 8-bit softmax's mean |β| in quantisation steps;
- ``recovered:CORPUS``: the share of what the row's baseline lost against its own baseline
  that the row wins back;
- ``group_name`` (a row name's part after ``GROUP: ``), ``estimate_mib``, ``estimate_ratio``
  (over the peak RSS), ``within`` (the ``factor`` setting), ``estimate_parts`` (the largest
  three): the memory estimate the row's job was admitted with;
- ``number:FIELD``: the row's FIELD (2 digits; ``-`` where it has none); the columns of the
  learned-mask tables: ``benchmarks.learned_columns``; of the low-rank table (``lowrank:label``,
  ``ratio``, ``ranks``, ``kept``, ``factorise``, ``statistics``): ``benchmarks.lowrank_rows``.

Rows are read through :func:`perplexity`, :func:`row_name` (``benchmarks.readers``),
:func:`reloaded` and :func:`estimate_ratio`, which also know the layouts of the rows written
before the tables (``magnitude.json``: each corpus at the top of the row; ``recipes.json``,
``runtime.json``, ``int8.json``: ``compressed`` and ``dense`` as bare numbers, a reload under
its runtime's name; ``pruning.json``: no names; ``maskllm.json``: ``ppl`` a bare number;
``memory_estimate.json``: the ratio rounded as stored), so the committed files render unchanged
and a rerun row sits beside them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from benchmarks.learned_columns import (
    LEARNED_CAPTION_VARIABLES,
    LEARNED_FAMILIES,
    LEARNED_FIXED,
)
from benchmarks.lowrank_rows import LOWRANK_FAMILIES
from benchmarks.lowrank_rows import note as lowrank_note
from benchmarks.readers import Record, perplexity, row_name, scored
from benchmarks.readers import number as _number


@dataclass(frozen=True)
class Context:
    """What a cell sees besides its row: every row by name, each row's baseline's name, the
    table's baseline, corpora and settings."""

    rows: Mapping[str, Record]
    baselines: Mapping[str, str]
    table_baseline: str | None = None
    corpora: tuple[str, ...] = ()
    settings: Mapping[str, Any] = field(default_factory=dict)

    def dense(self, corpus: str) -> float | None:
        """The dense model's perplexity as the table's baseline row scored it."""
        base = self.rows.get(self.table_baseline or "")
        return None if base is None else perplexity(base, corpus, "dense")

    def baseline(self, row: Record) -> Record | None:
        name = self.baselines.get(row_name(row))
        return None if name is None or name == row_name(row) else self.rows.get(name)


Cell = Callable[[Record, Context], Any]


@dataclass(frozen=True)
class Column:
    key: str
    header: str
    cell: Cell
    in_stage_rows: bool = False  # filled in a recipe's "after stage i" rows


def _measured(key: str) -> Callable[[Record], Any]:
    return lambda row: row.get(key)


# a measured value of a row, by the key the ratio columns divide by (ratio:KEY)
VALUES: dict[str, tuple[str, Callable[[str], Callable[[Record], Any]]]] = {
    "ppl": ("ppl ratio ({})", lambda corpus: lambda row: perplexity(row, corpus)),
    "wall_s": ("wall ratio", lambda _: _measured("wall_seconds")),
    "peak_rss_mib": ("RSS ratio", lambda _: _measured("peak_rss_mb")),
}


def _ratio(value: Callable[[Record], Any], digits: int, over: str | None = None) -> Cell:
    def cell(row: Record, context: Context) -> str:
        base = context.rows.get(over) if over else context.baseline(row)
        if base is None or value(base) is None or value(row) is None:
            return "-"
        return f"{value(row) / value(base):.{digits}f}"

    return cell


def _vs_dense(row: Record, context: Context) -> str:
    """The perplexity's change from the dense model's, per corpus (``+2.75 % / +2.84 %``)."""
    cells = []
    for corpus in context.corpora:
        dense = context.dense(corpus)
        cells.append(f"{100 * (perplexity(row, corpus) / dense - 1):+.2f} %" if dense else "-")
    return " / ".join(cells)


def _beta(row: Record, _context: Context) -> str:
    """The 8-bit softmax's mean |β| in quantisation steps."""
    bias = (row.get("softmax") or {}).get("bias")
    return f"{bias['mean_abs'] / bias['scale']:.3f}" if bias else "-"


def _recovered(corpus: str) -> Cell:
    """The share of what the row's baseline lost against its own baseline that the row wins
    back (the 8-bit softmax's loss over W8A8, won back by a correction)."""

    def cell(row: Record, context: Context) -> str:
        base = context.baseline(row)
        first = context.baseline(base) if base else None
        if first is None:
            return "-"
        lost = perplexity(base, corpus) - perplexity(first, corpus)
        won = perplexity(base, corpus) - perplexity(row, corpus)
        return f"{100 * won / lost:.0f} %" if lost > 0 else "-"

    return cell


def _layers(row: Record, digits: int) -> str:
    return f"{row['summary']['bytes_compressed'] / 2**20:.{digits}f}"


def _layers_ratio(row: Record, digits: int) -> str:
    summary = row["summary"]
    return f"{summary['bytes_compressed'] / summary['bytes_dense']:.{digits}f}"


def _file(row: Record, digits: int) -> str:
    return f"{row['compressed_file_bytes'] / 2**20:.{digits}f}"


def _params_kept(row: Record, digits: int) -> str:
    summary = row.get("summary")
    if not summary:  # a row that scored a checkpoint as it is
        return "-"
    return f"{summary['params_kept'] / summary['params_compressed_layers']:.{digits}f}"


def reloaded(row: Record) -> Record:
    """The reload of the output a line of the table shows (``runtime``): ``{perplexity, load,
    process_peak_rss_mb, wall_seconds}`` (``runtime.json``'s rows hold it under the runtime)."""
    runtime = row["runtime"]
    return row["reload"][runtime] if "reload" in row else row[runtime]


def _load(key: str, scale: float = 1) -> Callable[[Record, int | None], Any]:
    def value(row: Record, digits: int | None) -> Any:
        found = reloaded(row)["load"][key] / scale
        return found if digits is None else f"{found:.{digits}f}"

    return value


def counts_text(row: Record) -> bool:
    """Whether the row's memory estimate has the corpora's tokenizing in it (every row of a job
    that reads a corpus, since the estimate counts it)."""
    return any("token" in part for part in row["estimate_parts"])


def _estimate(row: Record, digits: int | None) -> str:
    """The memory estimate the job was admitted with, MiB († where it predates counting text)."""
    return f"{row['estimate_bytes'] / 2**20:.{digits or 0}f}" + ("" if counts_text(row) else " †")


def _parts(parts: dict[str, int]) -> str:
    top = sorted(parts.items(), key=lambda item: -item[1])[:3]
    return ", ".join(f"{name} {n / 2**20:.0f}" for name, n in top)


def estimate_ratio(row: Record) -> float:
    """The memory estimate over the peak RSS (as stored, rounded, in the rows that stored it)."""
    if "estimate_over_peak" in row:
        return row["estimate_over_peak"]
    return row["estimate_bytes"] / (row["peak_rss_mb"] * 2**20)


def within(row: Record, factor: float) -> bool:
    """Whether the estimate lies within ``factor`` of the peak, either way."""
    if "within_factor" in row:
        return row["within_factor"]
    return 1 / factor <= estimate_ratio(row) <= factor


def _field(key: str) -> Callable[[Record, int | None], Any]:
    """A field of the row as stored, or with ``digits`` (``-`` where the row has none)."""

    def value(row: Record, digits: int | None) -> Any:
        found = row.get(key)
        if found is None:
            return "-"
        return found if digits is None else f"{found:.{digits}f}"

    return value


# key -> (header, value(row, digits), default digits, shown in stage rows)
FIXED: dict[str, tuple[str, Callable[[Record, int | None], Any], int | None, bool]] = {
    "name": ("name", lambda row, _digits: row_name(row), None, True),
    "method": ("method", _field("method"), None, False),
    "sparsity": ("sparsity", _field("sparsity"), None, False),
    "tool": ("tool", _field("tool"), None, False),
    "wall_s": ("wall s", _field("wall_seconds"), None, False),
    "peak_rss_mib": ("peak RSS MiB", _field("peak_rss_mb"), None, False),
    "formats": ("stored format", lambda row, _digits: ", ".join(row["formats"]), None, False),
    "layers_mib": ("compressed layers MiB", _layers, 1, False),
    "layers_ratio": ("÷ dense fp32", _layers_ratio, 4, False),
    "file_mib": ("compressed.safetensors MiB", _file, 1, False),
    "params_kept": ("params kept", _params_kept, 3, False),
    "command": ("command", lambda row, _digits: f"`{row['command']}`", None, False),
    "runtime": ("runtime", _field("runtime"), None, False),
    "reload_mib": ("compressed layers MiB", _load("resident_bytes", 2**20), 1, False),
    "reload_ratio": ("÷ dense fp16", _load("ratio_to_dense_fp16"), 4, False),
    "reload_rss_mib": ("peak RSS after load MiB", _load("peak_rss_mib"), None, False),
    "reload_process_rss_mib": (
        "eval process peak RSS MiB",
        lambda row, _digits: reloaded(row)["process_peak_rss_mb"],
        None,
        False,
    ),
    "group_name": ("job", lambda row, _digits: row_name(row).partition(": ")[2], None, False),
    "estimate_mib": ("estimate", _estimate, 0, False),
    "estimate_parts": (
        "largest parts",
        lambda row, _digits: _parts(row["estimate_parts"]),
        0,
        False,
    ),
}
# key:CORPUS -> (header, perplexity(row, corpus)): the compressed model's, the dense model's as
# the row's job scored it, the reloaded output's
PERPLEXITIES: dict[str, tuple[str, Callable[[Record, str], float | None]]] = {
    "ppl": ("{} ppl", lambda row, corpus: perplexity(row, corpus)),
    "dense_ppl": ("dense {} ppl", lambda row, corpus: perplexity(row, corpus, "dense")),
    "reload_ppl": (
        "{} ppl (reloaded)",
        lambda row, corpus: perplexity(reloaded(row), corpus, "perplexity"),
    ),
}
# key -> (header, cell): the columns that read other rows or the table's corpora
CELLS: dict[str, tuple[str, Cell]] = {
    "vs_dense": ("vs dense", _vs_dense),
    "beta": ("mean abs β (steps)", _beta),
    "estimate_ratio": ("estimate / peak", lambda row, _c: f"{estimate_ratio(row):.2f}"),
    "within": (
        "within",
        lambda row, c: "yes" if within(row, c.settings.get("factor", 1.5)) else "**no**",
    ),
}
FIXED |= LEARNED_FIXED
# family:ARG -> (header, (arg, digits) -> cell, default digits)
FAMILIES: dict[str, tuple[str, Callable[[str, int], Cell], int]] = {
    "number": ("{}", lambda key, digits: lambda row, _c: _number(row.get(key), digits), 2),
    **LEARNED_FAMILIES,
    **LOWRANK_FAMILIES,
}
KEYS = (
    *FIXED,
    *CELLS,
    "recovered:CORPUS",
    *(f"{k}:ARG" for k in FAMILIES),
    *(f"{k}:CORPUS" for k in PERPLEXITIES),
    *(f"ratio:{k}" for k in VALUES if k != "ppl"),
    "ratio:ppl:CORPUS",
)


class UnknownColumn(ValueError):
    pass


def column(spec: str | Mapping[str, Any]) -> Column:
    """The column ``spec`` names (module docstring); :class:`UnknownColumn` if none."""
    spec = {"column": spec} if isinstance(spec, str) else dict(spec)
    key = spec.pop("column", None)
    header, digits = spec.pop("header", None), spec.pop("digits", None)
    over = spec.pop("over", None) if key and str(key).startswith("ratio:") else None
    if spec:
        raise UnknownColumn(f"column {key!r}: unknown key(s) {', '.join(map(str, spec))}")
    if not isinstance(key, str):
        raise UnknownColumn(f"a column needs a name (column: KEY), got {key!r}")
    kind, _, arg = key.partition(":")
    if key in FIXED:
        default, value, places, stages = FIXED[key]
        places = places if digits is None else digits
        return Column(key, header or default, lambda row, _c: value(row, places), stages)
    if key in CELLS:
        default, cell = CELLS[key]
        return Column(key, header or default, cell)
    if kind == "recovered" and arg:
        return Column(key, header or arg, _recovered(arg))
    if kind in FAMILIES and arg:
        default, cell, places = FAMILIES[kind]
        places = places if digits is None else digits
        return Column(key, header or default.format(arg), cell(arg, places))
    if kind in PERPLEXITIES and arg:
        default, value = PERPLEXITIES[kind]
        places = 2 if digits is None else digits
        cell = lambda row, _c: _number(value(row, arg), places)  # noqa: E731
        return Column(key, header or default.format(arg), cell, kind == "ppl")
    measured, _, corpus = arg.partition(":")
    if kind == "ratio" and measured in VALUES and bool(corpus) == (measured == "ppl"):
        default, value = VALUES[measured]
        places = (3 if measured == "ppl" else 2) if digits is None else digits
        return Column(key, header or default.format(corpus), _ratio(value(corpus), places, over))
    raise UnknownColumn(f"unknown column {key!r} (known: {', '.join(KEYS)})")


def flags(settings: Mapping[str, Any]) -> str:
    """The settings a job's flags show (``--seq-len 512 --nsamples 16 --eval wiki-test ...``)."""
    shown = [("seq_len", "--seq-len"), ("nsamples", "--nsamples"), ("corpora", "--eval")]
    parts = []
    for key, flag in [*shown, ("eval_tokens", "--eval-tokens")]:
        value = settings.get(key)
        if value is not None:
            parts += [flag, *(map(str, value) if isinstance(value, list) else [str(value)])]
    return " ".join(parts)


def _host(payload: Record) -> str:
    host = payload.get("machine", {})
    return (
        f"{host.get('cpu_model')} ({', '.join(host.get('isa') or [])}), "
        f"{host.get('torch_threads')} torch threads, torch {host.get('torch')}, "
        f"transformers {host.get('transformers')}"
    )


# the variables a caption may name besides the settings: (payload, settings) -> text; a
# section's caption sees its first row's settings
CAPTION_VARIABLES: dict[str, Callable[[Record, Mapping[str, Any]], str]] = {
    # the host the file's numbers were measured on
    "host": lambda payload, _settings: _host(payload),
    # the settings as the flags of a job
    "flags": lambda _payload, settings: flags(settings),
    # the lower end of the memory estimate's factor
    "factor_low": lambda _payload, settings: f"{1 / settings['factor']:.2f}",
    # the scored tokens of each corpus, from the first row
    "tokens": lambda payload, settings: ", ".join(
        f"{c} {scored(payload['results'][0], c)['tokens']}" for c in settings["corpora"]
    ),
    # the dense model's perplexities as the first row's job scored them, 3 digits
    "dense_ppl": lambda payload, settings: ", ".join(
        f"{c} {perplexity(payload['results'][0], c, 'dense'):.3f}" for c in settings["corpora"]
    ),
}


CAPTION_VARIABLES |= LEARNED_CAPTION_VARIABLES
CAPTION_VARIABLES["note"] = lowrank_note  # the results file's own note, after a space
