"""The one loop of every benchmark's ``main()``: :func:`run_table`.

A benchmark module holds its job table, what one job does and ``render(payload)`` (and
``plot``); its ``main()`` parses its flags and hands a :class:`Table` to :func:`run_table`, which
does the rest the same way for all of them:

- ``--render-only``: redraw ``NAME.md`` (and the PNG) from ``NAME.json``; run nothing;
- otherwise run the jobs (``--only``: some of ``table.jobs``, every other row kept from the
  results file), write ``NAME.json`` after each one (a kill keeps the finished ones) with the
  host the numbers were measured on (``machine``: :mod:`lmcompress.evaluation.host`), and draw
  the md (and PNG) from it;
- in a table of rows, a job that fails is logged and the others go on; the exit status is then
  1 (as for any run whose ``measure`` raises :class:`RunFailed` once it has written what it
  has). Job logs (and outputs) stay in ``--work`` (a new temporary directory by default), whose
  path is logged;
- a ``--smoke`` run (tiny shapes, seconds) writes into a new temporary directory unless
  ``--results-dir`` is given: never into ``benchmarks/results``.

Most benchmarks are a table of rows, one per job (:func:`row_table`); the others give their own
``measure``: one measurement in one go (``int8_speed``, ``streaming``, ``subnet_digits``), or
``kernels``, whose jobs (a model's shapes) each give many rows.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.render import (
    RESULTS_DIR,
    Plot,
    Render,
    merge_rows,
    read_json,
    render_files,
    write_results,
)
from benchmarks.runner import machine

log = logging.getLogger(__name__)

Record = dict[str, Any]
# (args, the jobs to run, the record on file when --only reruns some) -> the record, each time
# it has grown; args.work is the scratch directory
Measure = Callable[[argparse.Namespace, list[str], Record], Iterator[Record]]


class RunFailed(RuntimeError):
    """A run that finished with failures: what it measured is written, its exit status is 1."""


@dataclass(frozen=True)
class Table:
    """What a benchmark's run fills: ``results/NAME.{json,md}`` (``render``: the md from the
    JSON; ``plot``: ``NAME_curves.png``), by ``measure`` over the jobs picked from ``jobs``."""

    name: str
    render: Render
    measure: Measure
    jobs: Sequence[str] = ()
    plot: Plot | None = None


def by_name(row: dict[str, Any]) -> str:
    return row["name"]


def row_table(
    name: str,
    render: Render,
    jobs: Sequence[str],
    run: Callable[[str, argparse.Namespace], dict[str, Any]],
    record: Callable[[argparse.Namespace, list[dict]], Record],
    plot: Plot | None = None,
    field: str = "results",
    key: Callable[[dict], str] = by_name,
) -> Table:
    """A table of rows: ``run(job, args)`` runs one job and gives its row, which replaces the
    row of the same ``key`` in ``record[field]`` (kept in the order of ``jobs``);
    ``record(args, rows)`` is the JSON around the rows (settings, baselines)."""

    def measure(args: argparse.Namespace, names: list[str], previous: Record) -> Iterator[Record]:
        rows, failed = list(previous.get(field, [])), []
        for job in names:
            try:
                row = run(job, args)
            except Exception:  # noqa: BLE001 - one failed job must not lose the others
                log.exception("%s failed", job)
                failed.append(job)
                continue
            log.info("%s: %s", job, json.dumps(row)[:400])
            rows = merge_rows(rows, [row], key=key, order=jobs)
            yield record(args, rows)
        if failed:
            raise RunFailed(f"failed: {', '.join(failed)}")

    return Table(name, render, measure, jobs, plot)


def add_harness_args(
    parser: argparse.ArgumentParser, only_help: str | None = None, work: bool = True
) -> None:
    """The flags :func:`run_table` reads: --results-dir, --render-only, and (where a benchmark
    has them) --only JOB... and --work DIR."""
    parser.add_argument(
        "--results-dir",
        type=Path,
        help="read and write the results files here (default: benchmarks/results; a --smoke "
        "run: a new temporary directory)",
    )
    parser.add_argument(
        "--render-only",
        action="store_true",
        help="redraw the md (and png) from the results JSON; run nothing",
    )
    if only_help:
        parser.add_argument(
            "--only",
            nargs="+",
            default=[],
            metavar="JOB",
            help=only_help + "; merged into the JSON",
        )
    if work:
        parser.add_argument(
            "--work", type=Path, help="job logs (and outputs) here; default: a tmp dir"
        )


def add_merge_arg(parser: argparse.ArgumentParser) -> None:
    """``--merge DIR ...``: rows of runs made side by side, each in its own results dir."""
    parser.add_argument(
        "--merge", nargs="+", type=Path, default=[], metavar="DIR",
        help="merge the rows of these results dirs (runs made side by side) and redraw",
    )  # fmt: skip


def merge_results(
    results_dir: Path,
    others: Sequence[Path],
    name: str,
    order: Sequence[str],
    empty: Callable[[Path], Record],
    render: Render,
    plot: Plot | None = None,
) -> None:
    """``--merge``: the rows of ``others``' ``NAME.json`` replace those of the same name in
    ``results_dir``'s (``empty(results_dir)`` where there is none yet), in the job table's
    ``order``; the md and PNG are redrawn. A merged row measured on another host than the
    file's keeps its host record as the row's ``machine`` (machines here differ)."""
    payload = read_json(results_dir / f"{name}.json") or empty(results_dir)
    rows = payload["results"]
    for other in others:
        found = read_json(other / f"{name}.json")
        new = [
            _with_host(row, found.get("machine"), payload.get("machine"))
            for row in found["results"]
        ]
        rows = merge_rows(rows, new, key=by_name, order=order)
    write_results(results_dir, name, {**payload, "results": rows}, render, plot)


def _with_host(row: Record, host: Record | None, file_host: Record | None) -> Record:
    """``row`` with ``host`` as its ``machine`` where that differs from the file's host."""
    if not host or host == file_host or "machine" in row:
        return row
    return {**row, "machine": host}


def select_jobs(parser: argparse.ArgumentParser, names: Sequence[str], only: Sequence[str]) -> list:
    """The job names to run: all, or those of ``--only`` (an unknown name is a usage error)."""
    unknown = [name for name in only if name not in names]
    if unknown:
        parser.error(f"unknown job(s) {', '.join(unknown)}; known: {', '.join(names)}")
    return [name for name in names if not only or name in only]


def run_table(table: Table, args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Redraw (``--render-only``) or run ``table`` (module docstring); the exit status."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if args.render_only:
        results_dir = args.results_dir or RESULTS_DIR
        print(render_files(results_dir, table.name, table.render, table.plot))
        return 0
    only = getattr(args, "only", [])
    names = select_jobs(parser, table.jobs, only)
    args.results_dir = results_dir = _results_dir(args, table.name)
    results_dir.mkdir(parents=True, exist_ok=True)
    previous = _previous(results_dir, table.name) if only else {}
    if "work" in args:
        args.work = args.work or Path(tempfile.mkdtemp(prefix=f"lmcompress-{table.name}-"))
        args.work.mkdir(parents=True, exist_ok=True)
    host, status = machine(), 0
    try:
        for record in table.measure(args, names, previous):
            record = {**record, "machine": {**host, **record.get("machine", {})}}
            write_results(results_dir, table.name, record, table.render, table.plot)
    except RunFailed as err:
        log.error("%s", err)
        status = 1
    if (results_dir / f"{table.name}.json").is_file():
        print(render_files(results_dir, table.name, table.render, table.plot))
    if "work" in args:
        log.info("job logs (and outputs) in %s", args.work)
    return status


def _results_dir(args: argparse.Namespace, name: str) -> Path:
    if args.results_dir is not None:
        return args.results_dir
    if getattr(args, "smoke", False):
        scratch = Path(tempfile.mkdtemp(prefix=f"lmcompress-{name}-smoke-"))
        log.info("smoke run: results in %s", scratch)
        return scratch
    return RESULTS_DIR


def _previous(results_dir: Path, name: str) -> Record:
    """The record on file, whose rows a run of some jobs (``--only``) keeps."""
    previous = read_json(results_dir / f"{name}.json")
    if previous is None:
        log.warning("--only: no %s.json yet; writing only the rerun rows", name)
        return {}
    return previous
