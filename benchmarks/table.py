"""A sweep as data: ``benchmarks/tables/NAME.yaml``, read and checked (:func:`load_table`).

    settings:                 # the job every row shares (SETTINGS), as compress-model flags
      checkpoint: smollm2-135m
      corpora: [wiki-test, lee]
      eval_tokens: 32768
    rows:                     # in table order; each row one job (``--only NAME`` reruns it)
      - {name: dense, kind: eval}
      - name: magnitude 2:4   # kind: recipe (the default)
        recipe: {method: magnitude, sparsity: "2:4"}
    baseline: dense           # the row the ratio:* columns divide by (a row may name its own)
    columns: [name, ppl:wiki-test, ppl:lee, wall_s, peak_rss_mib]     # benchmarks.columns
    caption: SmolLM2-135M, scored tokens: {tokens}.    # settings and CAPTION_VARIABLES
    plot: null                # one of PLOTS (benchmarks.plots)

A row's ``recipe`` is the project's recipe format, what ``compress-model --config`` reads (a
mapping, written to the work directory, or a path such as ``recipes/sparsegpt24-int8.yaml``);
its ``kind`` is one of :data:`KINDS`. A row may also give its own ``settings`` (over the
table's), a ``baseline``, a ``source`` (the row whose output it reads), and ``line: false`` (a
line of a section only). ``stage_rows: true`` adds, under a multi-stage recipe's row, one line
per stage but the last with the perplexities after it; ``dense_line: NAME`` a first line with
the baseline row's dense scores; ``sections`` are tables of their own under the main one
(``caption``, ``rows``: names or globs, and ``columns`` or a ``render`` from
:data:`benchmarks.sections.SECTIONS`). Every mistake is one line naming the file
(:class:`TableError`): an unknown key, column, kind, setting, plot or render, a row name given
twice, a baseline or source naming no row, a caption naming no setting.

Beyond those: a row's ``note`` says what it is (a footer shows it: ``notes:``, one of
:data:`benchmarks.notes.NOTES`); ``results: FILE`` names the results file where it is not the
table's; ``copy: {from: TABLE(S), rows: {OURS: THEIRS}}`` copies rows of other results files into
this one's (``baselines``, drawn first); ``anchors`` holds mappings the rows merge with YAML's
``<<: *name``; ``stage_lines: true`` a line ``NAME (stage i)`` through every column for each
earlier stage a ``stages`` row scored; ``curves: true`` keeps each row's curves in
``results/FILE_curves.json``; a section's ``gap`` is the blank lines before it.
"""

from __future__ import annotations

import fnmatch
import string
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from benchmarks.columns import CAPTION_VARIABLES, Column, UnknownColumn, column
from benchmarks.lowrank_rows import KINDS as LOWRANK_KINDS
from benchmarks.notes import NOTES
from benchmarks.plots import PLOTS
from benchmarks.sections import SECTIONS

TABLES_DIR = Path(__file__).resolve().parent / "tables"
# what a row runs: a recipe through compress-model; the checkpoint scored as it is; a peer
# tool's pruning (llm-compressor, benchmarks/peers) scored like ours; the recipe as the README's
# command (its options as flags) from an empty cache, with only the table's eval_tokens; the
# source row's int8 output loaded by plain transformers (benchmarks.child.int8_interop); a
# recipe of a learned mask, its training record kept too; recipes run one after another, each
# a process of its own, a later one reading an earlier one's output (benchmarks.learned_rows);
# the low-rank table's statistics, factorisations and end-to-end jobs (benchmarks.lowrank_rows)
KINDS = ("recipe", "eval", "peer", "readme", "int8_interop", "learned", "stages", *LOWRANK_KINDS)
NO_RECIPE = ("eval", "int8_interop")
# setting -> what it is (the flags it becomes: benchmarks.sweep.job_flags)
SETTINGS = {
    "checkpoint": "the model every row compresses (compress-model's CHECKPOINT)",
    "corpora": "the corpora every row is scored on (--eval / --data)",
    "eval_tokens": "tokens scored per corpus (--eval-tokens; 0: all)",
    "seq_len": "tokens per calibration and evaluation window (--seq-len)",
    "nsamples": "calibration windows (--nsamples)",
    "calib": "the calibration corpus (--calib)",
    "seed": "the seed of the calibration windows (--seed)",
    "dense_copy": "false: the output without its dense copy (--no-dense-copy)",
    "skip_dense": "true: the compress job does not score the dense model (--skip-dense)",
    "score": "in-job: the compress job scores (its wall includes that); apart: "
    "compress-model eval scores its output in a process of its own",
    "save_dtype": "the dtype the output is saved in (--save-dtype)",
    "reload": "runtimes each recipe row's output is reloaded and scored in, each in a process "
    "of its own (compress-model eval --runtime R); a line of the table each",
    "streaming": "true: --streaming (one block in memory at a time; no evaluation)",
    "factor": "the factor the memory estimate aims to lie within of the peak RSS, either way "
    "(tests keep it the library's ESTIMATE_FACTOR)",
}
TOP = {"settings", "rows", "baseline", "columns", "caption", "plot", "stage_rows", "sections"}
TOP |= {"dense_line"}
SECTION = {"caption", "rows", "columns", "render"}
ROW = {"name", "kind", "recipe", "baseline", "settings", "source", "line"}
# results: the results file's name where it is not the table's (subnet -> subnet_smollm2);
# copy: rows of other results files drawn first; notes: a footer (benchmarks.notes);
# anchors: mappings the rows merge (`<<: *name`), read by YAML alone;
# stage_lines: each earlier stage scored, a line "NAME (stage i)" through every column;
# curves: each row's curves kept apart, in results/FILE_curves.json (by row name)
TOP |= {"results", "copy", "notes", "anchors", "stage_lines", "curves"}
SECTION |= {"gap"}
ROW |= {"note"}
COPY = {"from", "rows"}


class TableError(ValueError):
    """A table file that cannot be run: one line, naming the file."""


@dataclass(frozen=True)
class Row:
    name: str
    kind: str = "recipe"
    recipe: dict[str, Any] | str | None = None
    baseline: str | None = None
    settings: dict[str, Any] = field(default_factory=dict)  # over the table's, for this row
    source: str | None = None  # the row whose output this one reads (int8_interop)
    line: bool = True  # a line of the main table (else only of a section, or of a footer)
    note: str | None = None  # what the row is, in words (a footer's)


@dataclass(frozen=True)
class Section:
    """A table of its own under the main one: some rows (no longer lines of the main table),
    other columns, a caption (which ends in a colon, before the table)."""

    caption: str
    rows: tuple[str, ...]
    columns: tuple[Column, ...] = ()
    render: str | None = None  # instead of columns: one of benchmarks.sections.SECTIONS
    gap: int = 1  # blank lines before its caption


@dataclass(frozen=True)
class Copy:
    """Rows of other tables' results files, copied into this one's record when it is written
    (``baselines``) and drawn before its own: ``from`` the tables (the first file that has a row
    gives it), ``rows`` our name -> its name there (or its names, one a file)."""

    tables: list[str]
    rows: dict[str, list[str]]


@dataclass(frozen=True)
class Table:
    name: str
    settings: dict[str, Any]
    rows: tuple[Row, ...]
    columns: tuple[Column, ...]
    caption: str
    baseline: str | None = None
    plot: str | None = None
    stage_rows: bool = False
    sections: tuple[Section, ...] = ()
    dense_line: str | None = None  # a first line: the baseline row's dense scores, so named
    results: str | None = None  # the results file's name, where it is not the table's
    copy: Copy | None = None
    notes: str | None = None  # one of benchmarks.notes.NOTES, drawn after the tables
    stage_lines: bool = False  # each earlier stage scored, a line "NAME (stage i)" of its own
    curves: bool = False  # each row's curves kept in results/FILE_curves.json, by row

    @property
    def file(self) -> str:
        """The results file's name: ``results/FILE.{json,md}``."""
        return self.results or self.name

    def row(self, name: str) -> Row:
        return next(r for r in self.rows if r.name == name)

    @property
    def baselines(self) -> dict[str, str]:
        """Each row's name -> its baseline's (the rows that have one)."""
        named = {r.name: r.baseline or self.baseline for r in self.rows}
        return {name: base for name, base in named.items() if base}


def table_names() -> list[str]:
    return sorted(p.stem for p in TABLES_DIR.glob("*.yaml"))


def load_table(name: str, path: Path | None = None) -> Table:
    """The table ``benchmarks/tables/NAME.yaml`` (or ``path``), checked; :class:`TableError`."""
    path = path or TABLES_DIR / f"{name}.yaml"
    if not path.is_file():
        raise TableError(f"no table {name!r} ({path} missing; tables: {', '.join(table_names())})")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise TableError(f"{path}: not YAML: {' '.join(str(err).split())}") from None
    try:
        return _parse(name, data)
    except (TableError, UnknownColumn) as err:
        raise TableError(f"{path}: {err}") from None


def _unknown(found: Any, known: set[str], where: str) -> None:
    if not isinstance(found, dict):
        raise TableError(f"{where}: a mapping expected, got {type(found).__name__}")
    extra = sorted(set(map(str, found)) - known)
    if extra:
        known_keys = ", ".join(sorted(known))
        raise TableError(f"{where}: unknown key(s) {', '.join(extra)} (known: {known_keys})")


def _parse(name: str, data: Any) -> Table:
    _unknown(data, TOP, "table")
    settings = data.get("settings") or {}
    _unknown(settings, set(SETTINGS), "settings")
    rows = tuple(_row(i, spec) for i, spec in enumerate(data.get("rows") or []))
    if not rows:
        raise TableError("rows: a table needs at least one row")
    names = [r.name for r in rows]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise TableError(f"rows: row name(s) given twice: {', '.join(twice)}")
    baseline = data.get("baseline")
    bases = [("baseline", baseline), *((f"row {r.name!r}: baseline", r.baseline) for r in rows)]
    bases += [(f"row {r.name!r}: source", r.source) for r in rows]
    for where, base in bases:
        if base is not None and base not in names:
            raise TableError(f"{where}: {base!r} names no row (rows: {', '.join(names)})")
    columns = tuple(column(spec) for spec in data.get("columns") or [])
    if not columns:
        raise TableError("columns: a table needs at least one column")
    caption = str(data.get("caption") or "")
    captions = [
        caption,
        *(str(s.get("caption", "")) for s in data.get("sections") or [] if isinstance(s, dict)),
    ]
    fields = {f for text in captions for _, f, _, _ in string.Formatter().parse(text) if f}
    unknown = sorted(fields - set(SETTINGS) - set(CAPTION_VARIABLES))
    if unknown:
        known = ", ".join([*SETTINGS, *CAPTION_VARIABLES])
        raise TableError(f"caption: unknown variable(s) {', '.join(unknown)} (known: {known})")
    plot = data.get("plot")
    if plot is not None and plot not in PLOTS:
        raise TableError(f"plot: unknown plot {plot!r} (known: {', '.join(PLOTS) or 'none'})")
    stage_rows = bool(data.get("stage_rows", False))
    sections = tuple(_section(i, spec, names) for i, spec in enumerate(data.get("sections") or []))
    dense_line = data.get("dense_line")
    table = Table(
        name, settings, rows, columns, caption, baseline, plot, stage_rows, sections, dense_line
    )
    return _extras(table, data)


def _extras(table: Table, data: dict[str, Any]) -> Table:
    """The table with its ``results``, ``copy`` and ``notes``, checked."""
    notes, copy = data.get("notes"), data.get("copy")
    if notes is not None and notes not in NOTES:
        raise TableError(f"notes: unknown notes {notes!r} (known: {', '.join(NOTES)})")
    if copy is not None:
        _unknown(copy, COPY, "copy")
        if not isinstance(copy.get("rows"), dict) or not copy["rows"]:
            raise TableError("copy: rows: a mapping of our name -> the row's name there")
        sources = copy.get("from")
        sources = [str(s) for s in (sources if isinstance(sources, list) else [sources])]
        names = {str(k): [str(n) for n in (v if isinstance(v, list) else [v])]
                 for k, v in copy["rows"].items()}  # fmt: skip
        copy = Copy(sources, names)
    results = data.get("results")
    stage_lines = bool(data.get("stage_lines", False))
    results = results and str(results)
    curves = bool(data.get("curves", False))
    return replace(
        table, results=results, copy=copy, notes=notes, stage_lines=stage_lines, curves=curves
    )


def _section(index: int, spec: Any, names: list[str]) -> Section:
    where = f"sections[{index}]"
    _unknown(spec, SECTION, where)
    patterns = list(spec.get("rows") or [])  # names, or glob patterns ("tiny *")
    unknown = [p for p in patterns if not fnmatch.filter(names, p)]
    if not patterns or unknown:
        raise TableError(f"{where}: rows: {', '.join(map(repr, unknown)) or 'none'} (a row each)")
    rows = tuple(n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns))
    columns, render = tuple(column(c) for c in spec.get("columns") or []), spec.get("render")
    if render is not None and render not in SECTIONS:
        raise TableError(f"{where}: unknown render {render!r} (known: {', '.join(SECTIONS)})")
    if not columns and not render:
        raise TableError(f"{where}: a section needs columns (or a render)")
    return Section(str(spec.get("caption", "")), rows, columns, render, int(spec.get("gap", 1)))


def _row(index: int, spec: Any) -> Row:
    where = f"rows[{index}]"
    _unknown(spec, ROW, where)
    name, kind, recipe = spec.get("name"), spec.get("kind", "recipe"), spec.get("recipe")
    if not isinstance(name, str) or not name:
        raise TableError(f"{where}: a row needs a name")
    if kind not in KINDS:
        raise TableError(f"row {name!r}: unknown kind {kind!r} (known: {', '.join(KINDS)})")
    if (recipe is None) != (kind in NO_RECIPE):
        need = "no recipe" if kind in NO_RECIPE else "a recipe"
        raise TableError(f"row {name!r}: a row of kind {kind} takes {need}")
    if recipe is not None and not isinstance(recipe, (dict, str)):
        raise TableError(f"row {name!r}: recipe: a mapping or a recipe file's path")
    if (spec.get("source") is None) == (kind == "int8_interop"):
        raise TableError(
            f"row {name!r}: a source (the row whose output it reads) is for int8_interop"
        )
    settings = spec.get("settings") or {}
    _unknown(settings, set(SETTINGS), f"row {name!r}: settings")
    line = bool(spec.get("line", True))
    source, note = spec.get("source"), spec.get("note")
    return Row(name, kind, recipe, spec.get("baseline"), settings, source, line, note)
