"""Mutation check: apply single-line mutations one at a time and see whether the tests notice.

Each mutation of ``scripts/mutations.yaml`` (file, the exact original line, its replacement,
the tests to run) is applied to a scratch copy of the tree (the tracked and untracked,
not-ignored files of the working tree), never to the tree itself; the named tests run there
with ``pytest -x -q``; the file is restored before the next one. A mutation is *caught* when
pytest exits non-zero, *survived* when the tests pass. The named tests are first run once on
the unmutated copy: a failing baseline stops the run (a mutation would look caught for
nothing).

    OMP_NUM_THREADS=1 .venv/bin/python scripts/mutate.py            # all, into benchmarks/results
    .venv/bin/python scripts/mutate.py --only wanda-per-row --out /tmp/m

Writes ``<out>/mutations.json`` and ``<out>/mutations.md``: host, time, commit, and per
mutation the diff, the outcome, the first failing assertion, and for a survivor its verdict
from the table (why it is equivalent) or "no test catches it".
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
TABLE = ROOT / "scripts" / "mutations.yaml"
OUT = ROOT / "benchmarks" / "results"
KEYS = {"id", "file", "original", "replacement", "tests"}


@dataclass
class Mutation:
    id: str
    file: str
    original: str  # the line's text without its indentation
    replacement: str
    tests: list[str]
    verdict: str | None = None  # for a mutation the tests are not expected to catch
    killed_by: str | None = None  # the test added because the mutation once survived


@dataclass
class Outcome:
    id: str
    file: str
    line: int
    diff: list[str]
    tests: list[str]
    caught: bool
    exit_code: int
    seconds: float
    failure: str | None  # the first assertion or error pytest printed
    verdict: str
    killed_by: str | None = None


def load_table(path: Path) -> list[Mutation]:
    entries = yaml.safe_load(path.read_text())
    mutations = []
    for entry in entries:
        missing = KEYS - set(entry)
        if missing:
            raise SystemExit(f"{path}: {entry.get('id', entry)} lacks {sorted(missing)}")
        mutations.append(Mutation(**entry))
    ids = [m.id for m in mutations]
    if len(set(ids)) != len(ids):
        raise SystemExit(f"{path}: duplicate ids")
    return mutations


def mutated_text(text: str, original: str, replacement: str) -> tuple[str, int]:
    """``text`` with the one line whose stripped text is ``original`` replaced (indentation
    kept), and that line's number (1-based). A line found 0 or 2+ times is an error."""
    lines = text.splitlines(keepends=True)
    found = [i for i, line in enumerate(lines) if line.strip() == original.strip()]
    if len(found) != 1:
        raise ValueError(f"{original!r} occurs {len(found)} times, expected once")
    i = found[0]
    line = lines[i]
    indent = line[: len(line) - len(line.lstrip())]
    ending = line[len(line.rstrip("\r\n")) :]
    lines[i] = indent + replacement.strip() + ending
    return "".join(lines), i + 1


def scratch_copy(root: Path, dest: Path) -> None:
    """The working tree's tracked and untracked-but-not-ignored files, copied into ``dest``."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        check=True,
        capture_output=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = root / name
        if source.is_file():
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def run_tests(tree: Path, tests: list[str], timeout: float) -> tuple[int, str, float]:
    """``pytest -x -q`` on ``tests`` inside ``tree``: (exit code, output, seconds)."""
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "pytest", *tests, "-x", "-q", "-p", "no:cacheprovider"]
    command += ["--basetemp", str(tree.parent / "pytest-tmp")]
    start = time.perf_counter()
    try:
        done = subprocess.run(
            command, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout
        )
        code, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as err:
        code, output = 124, f"timed out after {timeout:.0f} s\n{err.stdout or ''}"
    return code, output, time.perf_counter() - start


def first_failure(output: str) -> str | None:
    """The first ``E ...`` line pytest printed (the failing assertion), else its last line."""
    for line in output.splitlines():
        if line.startswith("E "):
            return line[1:].strip()[:300]
    lines = [line for line in output.splitlines() if line.strip()]
    return lines[-1][:300] if lines else None


def check(tree: Path, mutation: Mutation, timeout: float) -> Outcome:
    """Apply ``mutation`` in ``tree``, run its tests, restore the file (always)."""
    path = tree / mutation.file
    text = path.read_text()
    mutated, line = mutated_text(text, mutation.original, mutation.replacement)
    try:
        path.write_text(mutated)
        code, output, seconds = run_tests(tree, mutation.tests, timeout)
    finally:
        path.write_text(text)
    caught = code != 0
    if caught:
        verdict = "caught"
    else:
        verdict = mutation.verdict or "survived: no test catches it"
    return Outcome(
        id=mutation.id,
        file=mutation.file,
        line=line,
        diff=[f"- {mutation.original.strip()}", f"+ {mutation.replacement.strip()}"],
        tests=mutation.tests,
        caught=caught,
        exit_code=code,
        seconds=round(seconds, 1),
        failure=first_failure(output) if caught else None,
        verdict=verdict,
        killed_by=mutation.killed_by,
    )


def header() -> dict:
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    # uncommitted changes count, except this script's own results
    tracked = ["git", "diff", "--quiet", "HEAD", "--", ".", ":!benchmarks/results/mutations.*"]
    dirty = subprocess.run(tracked, cwd=ROOT).returncode != 0
    return {
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "time_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit + ("+dirty" if dirty else ""),
    }


def render(meta: dict, outcomes: list[Outcome]) -> str:
    caught = sum(o.caught for o in outcomes)
    killed = sum(o.caught and o.killed_by is not None for o in outcomes)
    lines = [
        "# Mutation check (`python scripts/mutate.py`)",
        "",
        f"{meta['host']}, {meta['time_utc']}, commit {meta['commit']}, python {meta['python']}, "
        f"{meta['cpus']} CPUs; table `scripts/mutations.yaml`.",
        "",
        *(
            [
                f"Rerun at that time: {', '.join(meta['rerun_ids'])}; the other rows are from the "
                f"run of {meta['other_rows_from']}.",
                "",
            ]
            if meta.get("rerun_ids")
            else []
        ),
        f"{len(outcomes)} single-line mutations tried, {caught} caught by the named tests "
        f"({killed} of them only by a test added when it first survived: the test is named), "
        f"{len(outcomes) - caught} survived (each with its verdict).",
        "",
        "| id | where | mutation | tests | outcome | s | failing assertion / verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        mutation = "<br>".join(f"`{d}`".replace("|", "\\|") for d in o.diff)
        tests = "<br>".join(Path(t).name for t in o.tests)
        note = (o.failure if o.caught else o.verdict) or ""
        if o.caught and o.killed_by:
            note = f"{note} — first survived; killed by `{o.killed_by}`"
        note = note.replace("|", "\\|").replace("\n", " ")
        outcome = "caught" if o.caught else "**survived**"
        cells = [o.id, f"`{o.file}:{o.line}`", mutation, tests, outcome, o.seconds, note]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines) + "\n"


def merged(previous: dict, rows: list[dict], table: Path) -> list[dict]:
    """``previous`` run's rows with ``rows`` in place of those of the same id, in the table's
    order (a row whose id left the table is dropped)."""
    by_id = {row["id"]: row for row in previous.get("mutations", [])}
    by_id.update({row["id"]: row for row in rows})
    return [by_id[m.id] for m in load_table(table) if m.id in by_id]


def rerender(out: Path, mutations: list[Mutation]) -> int:
    """``out``'s results again, each row's ``killed_by`` taken from the table."""
    result = json.loads((out / "mutations.json").read_text())
    notes = {m.id: m.killed_by for m in mutations}
    for row in result["mutations"]:
        row["killed_by"] = notes.get(row["id"])
    (out / "mutations.json").write_text(json.dumps(result, indent=2) + "\n")
    outcomes = [Outcome(**row) for row in result["mutations"]]
    (out / "mutations.md").write_text(render(result, outcomes))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", type=Path, default=TABLE)
    parser.add_argument(
        "--only",
        nargs="*",
        help="mutation ids to run (default: all); their rows replace "
        "those of the same ids in an existing mutations.json",
    )
    parser.add_argument("--out", type=Path, default=OUT, help="folder for mutations.{json,md}")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per pytest run")
    parser.add_argument(
        "--render",
        action="store_true",
        help="rewrite <out>/mutations.{json,md} from the "
        "json and the table's killed_by notes, running nothing",
    )
    args = parser.parse_args(argv)
    # killed: unwind, so that pytest is stopped and the scratch copy removed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    mutations = load_table(args.table)
    if args.render:
        return rerender(args.out, mutations)
    if args.only:
        unknown = set(args.only) - {m.id for m in mutations}
        if unknown:
            parser.error(f"unknown ids: {sorted(unknown)}")
        mutations = [m for m in mutations if m.id in args.only]
    meta = header()
    with tempfile.TemporaryDirectory(prefix="mutate-") as scratch:
        tree = Path(scratch) / "tree"
        scratch_copy(ROOT, tree)
        for m in mutations:  # every line is there once before any test runs
            mutated_text((tree / m.file).read_text(), m.original, m.replacement)
        tests = list(dict.fromkeys(t for m in mutations for t in m.tests))
        code, output, seconds = run_tests(tree, tests, args.timeout * len(mutations))
        if code != 0:
            print(output[-3000:], file=sys.stderr)
            raise SystemExit(f"the unmutated tests fail (exit {code}): fix them first")
        print(f"baseline: {len(tests)} test paths pass ({seconds:.0f} s)", flush=True)
        outcomes = []
        for m in mutations:
            outcome = check(tree, m, args.timeout)
            outcomes.append(outcome)
            print(f"{m.id}: {outcome.verdict} ({outcome.seconds} s)", flush=True)
    meta["baseline_seconds"] = round(seconds, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = [asdict(o) for o in outcomes]
    if args.only and (args.out / "mutations.json").is_file():  # rerun rows replace old ones
        previous = json.loads((args.out / "mutations.json").read_text())
        rows = merged(previous, rows, args.table)
        meta["rerun_ids"] = sorted(args.only)
        meta["other_rows_from"] = previous.get("other_rows_from") or previous.get("time_utc")
        outcomes = [Outcome(**row) for row in rows]
    result = {**meta, "mutations": rows}
    (args.out / "mutations.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "mutations.md").write_text(render(meta, outcomes))
    survivors = [o.id for o in outcomes if not o.caught and not o.verdict.startswith("equiv")]
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
