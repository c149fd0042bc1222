"""The probes of ``benchmarks.bad_inputs`` that are real processes, and the helpers every probe
shares: run the CLI (or a Python program) in a directory and record the row.

- ``two runs writing one -o at once``: a second job on the output a first one holds;
- the races of issue 39 (:data:`~benchmarks.bad_inputs_probes.RACES`): a file written into
  ``-o`` during a job, and jobs on nested outputs;
- the kills: SIGKILL or SIGTERM once the save has begun (then, after SIGKILL, the same job
  again);
- the exported files' modes and sizes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.bad_inputs_probes import MODES, QUICK, RACES, WRITERS
from benchmarks.runner import CLI
from lmcompress.compressor.util.locks import lock_path


def listing(work: Path) -> list[str]:
    return sorted(str(p.relative_to(work)) for p in work.rglob("*"))


def run_cli(
    argv: tuple[str, ...], work: Path, env: dict[str, str | None] | None = None, python=False
) -> tuple[int, float, str]:
    command = [sys.executable, "-c", argv[0]] if python else [*CLI, *argv]
    environ = dict(os.environ)
    for key, value in (env or {}).items():
        if value is None:
            environ.pop(key, None)
        else:
            environ[key] = value
    start = time.perf_counter()
    done = subprocess.run(
        command, cwd=work, capture_output=True, text=True, check=False, env=environ
    )
    return done.returncode, time.perf_counter() - start, done.stderr


def make_row(name: str, code: int, seconds: float, stderr: str, left: list[str]) -> dict[str, Any]:
    lines = [line for line in stderr.splitlines() if line.strip()]
    return {
        "name": name,
        "exit": code,
        "seconds": round(seconds, 1),
        "stderr_lines": len(lines),
        "message": lines[-1] if lines else "",
        "left_behind": left,
    }


def run_writers(work: Path) -> dict[str, Any]:
    """Two real runs name one output: the first (a long SparseGPT job) holds it; the second
    starts once the first's lock exists, and must be refused naming the first."""
    work.mkdir(parents=True)
    first = subprocess.Popen(
        [*CLI, "--method", "sparsegpt", "--eval", "-o", "out"],
        cwd=work,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while not lock_path(work / "out").exists():
            if first.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the first run took no lock")
            time.sleep(0.05)
        code, seconds, stderr = run_cli((*QUICK, "-o", "out"), work)
        first_running = first.poll() is None
    finally:
        first.send_signal(signal.SIGTERM)
        first_code = first.wait()
    row = make_row(WRITERS, code, seconds, stderr, listing(work))
    row["first_run"] = {"still running": first_running, "exit after SIGTERM": first_code}
    row["expect"] = 2
    row["ok"] = code == 2 and row["stderr_lines"] == 1 and first_running and not listing(work)
    return row


def _wait_for_lock(proc: subprocess.Popen, output: Path, settle: float = 0.0) -> None:
    """Until ``proc`` holds ``output``'s lock (then ``settle`` seconds more: past its checks)."""
    deadline = time.monotonic() + 120
    while not lock_path(output).exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the first run took no lock on {output}")
        time.sleep(0.05)
    time.sleep(settle)


def run_race(name: str, work: Path) -> dict[str, Any]:
    """Two real processes on one output tree (issue 39). ``written``: while a job writes
    ``out``, another process writes ``out/notes.txt``; the job must refuse at its save (exit
    2, one line), the file must be intact and the job's result kept beside it (``out.new-*``).
    ``nested``: a second job on a path inside or around a running one's is refused, and (after
    a refused ``--overwrite`` around it) so is a third on the running one's own path."""
    kind, spec = RACES[name]
    work.mkdir(parents=True)
    if kind == "written":
        if spec:  # --overwrite: an old output the job may replace, as it was when it started
            (work / "out").mkdir()
            (work / "out" / "old.txt").write_text("old")
        job = subprocess.Popen(
            [*CLI, *QUICK, "-o", "out", "-q", *spec], cwd=work, stderr=subprocess.PIPE, text=True
        )
        _wait_for_lock(job, work / "out", settle=3.0)  # the job is past its checks
        writer = "import os; os.makedirs('out', exist_ok=True); open('out/notes.txt', 'w')"
        writer += ".write('mine')"
        subprocess.run([sys.executable, "-c", writer], cwd=work, check=True)
        start = time.perf_counter()
        stderr = job.communicate()[1]
        row = make_row(name, job.returncode, time.perf_counter() - start, stderr, [])
        notes = work / "out" / "notes.txt"
        kept = [p for p in work.glob("out.new-*") if (p / "compression.json").is_file()]
        row["notes_intact"] = notes.is_file() and notes.read_text() == "mine"
        row["result_kept"] = [p.name for p in kept]
        row["message"] += f"; out/notes.txt intact: {row['notes_intact']}; result kept in "
        row["message"] += ", ".join(row["result_kept"]) or "nothing"
        row["expect"] = 2
        row["ok"] = job.returncode == 2 and row["stderr_lines"] == 1 and row["notes_intact"]
        row["ok"] = row["ok"] and len(kept) == 1
        return row
    first_out, second_out = spec
    first = subprocess.Popen(
        [*CLI, "--method", "sparsegpt", "--eval", "-o", first_out],
        cwd=work,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for_lock(first, work / first_out)
        overwrite = ("--overwrite",) if len(second_out) < len(first_out) else ()
        code, seconds, stderr = run_cli((*QUICK, "-o", second_out, *overwrite), work)
        third = None
        if overwrite:  # the running job's lock must have survived the refused --overwrite
            third = run_cli((*QUICK, "-o", first_out), work)
        first_running = first.poll() is None
    finally:
        first.send_signal(signal.SIGTERM)
        first_code = first.wait()
    left = listing(work)
    row = make_row(name, code, seconds, stderr, left)
    row["first_run"] = {"still running": first_running, "exit after SIGTERM": first_code}
    row["expect"] = 2
    row["ok"] = code == 2 and row["stderr_lines"] == 1 and first_running and not left
    if third is not None:
        lines = [line for line in third[2].splitlines() if line.strip()]
        row["third_run"] = {"exit": third[0], "message": lines[-1] if lines else ""}
        said = row["third_run"]["message"]
        row["message"] += f"; a third -o {first_out}: exit {third[0]}, {said}"
        row["ok"] = row["ok"] and third[0] == 2 and len(lines) == 1
    return row


def run_kill(name: str, work: Path) -> dict[str, Any]:
    """Start the quick job, signal it once its output's temporary sibling exists."""
    work.mkdir(parents=True)
    sig = signal.SIGKILL if name.startswith("SIGKILL") else signal.SIGTERM
    argv = (*QUICK, "-o", "out")
    start = time.perf_counter()
    proc = subprocess.Popen([*CLI, *argv], cwd=work, stderr=subprocess.PIPE, text=True)
    while proc.poll() is None and not list(work.glob(".out.tmp-*/*")):
        time.sleep(0.05)
    if proc.poll() is not None:
        raise RuntimeError(f"{name}: the job ended before its save began")
    time.sleep(0.3)  # inside the save
    proc.send_signal(sig)
    stderr = proc.communicate()[1]
    row = make_row(name, proc.returncode, time.perf_counter() - start, stderr, listing(work))
    if sig == signal.SIGKILL:  # nothing can clean up after SIGKILL: the next run must
        code, seconds, again = run_cli((*argv, "-q"), work)
        row["next_run"] = {
            "exit": code,
            "seconds": round(seconds, 1),
            "warned": [line for line in again.splitlines() if "stale" in line],
            "left_behind": [p for p in listing(work) if not p.startswith("out")],
        }
    return row


def run_modes(work: Path) -> dict[str, Any]:
    work.mkdir(parents=True)
    code, seconds, stderr = run_cli((*QUICK, "-o", "out", "-q"), work)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in sorted((work / "out").iterdir())}
    row = make_row(MODES, code, seconds, stderr, [])
    umask = os.umask(0)
    os.umask(umask)
    row["umask"] = oct(umask)
    row["modes"] = modes
    # what the output weighs with and without the dense copy (fp32, the model's own dtype)
    run_cli((*QUICK, "--no-dense-copy", "-o", "lean", "-q"), work)
    row["sizes_mb"] = {
        out: {p.name: round(p.stat().st_size / 1e6, 1) for p in sorted((work / out).iterdir())}
        for out in ("out", "lean")
    }
    return row
