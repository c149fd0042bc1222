"""The one job runner of every benchmark: a subprocess per job, its wall time and peak RSS, and
its result read back as JSON.

Why a process per job: peak RSS is a high-water mark that never comes down inside a process,
so two jobs run in one process would share it (and the second would inherit the first's
allocator state). Each job is a command line, so the same runner starts our CLI, a benchmark's
own ``--child`` entry point, ``accelerate launch``, or llm-compressor in its own venv.

Peak RSS is the kernel's ``ru_maxrss`` of the job's process (``os.wait4``): the number GNU
``time -v`` prints as "Maximum resident set size", with which the results written before this
runner were measured. For a job that starts processes of its own (``accelerate launch``) it is
the largest single process of the tree, not their sum. Like GNU ``time``, the runner forks the
job from a small process (``_MEASURE``, a bare interpreter of ~10 MiB) and not from the
benchmark itself: Linux carries the RSS a process had when it forked over ``exec`` into the
child's ``ru_maxrss``, so a job forked from a benchmark holding torch (~250 MiB) could never
report less than that.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
CLI = (PYTHON, "-m", "lmcompress.cli.main")  # compress-model, from this venv
STDOUT = "stdout"  # Job.reads: the JSON document at the end of the job's stdout

# argv: MEASUREMENTS_FILE COMMAND...; runs COMMAND as its child and writes
# "wall_seconds max_rss_kib exit_code" (SIGTERM is passed on to the job).
_MEASURE = """
import os, signal, sys, time
start = time.perf_counter()
pid = os.fork()
if pid == 0:
    try:
        os.execvp(sys.argv[2], sys.argv[2:])
    finally:
        os._exit(127)
signal.signal(signal.SIGTERM, lambda *_: os.kill(pid, signal.SIGTERM))
_, status, usage = os.wait4(pid, 0)
wall = time.perf_counter() - start
with open(sys.argv[1], "w") as f:
    f.write(f"{wall} {usage.ru_maxrss} {os.waitstatus_to_exitcode(status)}")
"""


def measured_argv(measured: str | Path, command: Sequence[str]) -> list[str]:
    """``command`` as the child of a small fresh interpreter that writes "wall_seconds
    max_rss_kib exit_code" to ``measured``: forked from a large process (pytest, a sweep) the
    job's ``ru_maxrss`` would start at that process's own peak."""
    return [PYTHON, "-I", "-S", "-c", _MEASURE, str(measured), *map(str, command)]


@dataclass(frozen=True)
class Job:
    """One command to run as its own process.

    ``reads`` says where its result is: ``"stdout"`` (the JSON document that ends its stdout:
    a one-line record after log lines, or ``--json``'s indented document), a path (a JSON file
    the job writes), or None (only wall time and peak RSS are wanted). ``env`` is added to this
    process's environment (``TQDM_DISABLE=1`` is always set: progress bars would only fill the
    logs). With ``check`` a non-zero exit raises ``JobFailed``; without, the caller decides.
    """

    name: str
    command: Sequence[str]
    reads: str | Path | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    check: bool = True


@dataclass(frozen=True)
class Run:
    """What one job gave: its measurements, its result (None if it wrote none), its logs."""

    name: str
    wall_seconds: float
    peak_rss_mb: float
    returncode: int
    result: Any
    stdout: Path
    stderr: Path


class JobFailed(RuntimeError):
    """A job exited non-zero (or wrote no readable result); the message ends with its log."""


def run_job(job: Job, work: str | Path) -> Run:
    """Run ``job`` from the repository root with its stdout and stderr in ``work/NAME.{out,log}``.

    The files are kept (an hour-long job that fails keeps its whole log). Raises ``JobFailed``
    on a non-zero exit (with ``job.check``) or when the result named by ``job.reads`` cannot be
    read after a successful exit.
    """
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    stem = work / slug(job.name)
    out_path, log_path = Path(f"{stem}.out"), Path(f"{stem}.log")
    env = {**os.environ, "TQDM_DISABLE": "1", **job.env}
    command = [str(part) for part in job.command]
    log.info("%s: %s", job.name, " ".join(command))
    measured = Path(f"{stem}.measured")
    measured.unlink(missing_ok=True)
    measure = measured_argv(measured, command)
    with out_path.open("w") as stdout, log_path.open("w") as stderr:
        proc = subprocess.Popen(measure, stdout=stdout, stderr=stderr, cwd=ROOT, env=env)
        try:
            proc.wait()
        except BaseException:  # Ctrl-C: do not leave an hour-long job running
            proc.terminate()
            proc.wait()
            raise
    try:
        wall, max_rss_kib, returncode = measured.read_text().split()
    except (OSError, ValueError):
        message = f"{job.name}: not measured (exit {proc.returncode})\n{_tail(log_path)}"
        raise JobFailed(message) from None
    returncode = int(returncode)
    measured.unlink()
    if returncode != 0 and job.check:
        command_line = " ".join(command)
        raise JobFailed(f"{job.name}: exit {returncode}: {command_line}\n{_tail(log_path)}")
    try:
        result = _read(job.reads, out_path)
    except (OSError, ValueError) as err:
        if returncode == 0 and job.check:
            raise JobFailed(f"{job.name}: no result ({err})\n{_tail(log_path)}") from None
        result = None
    return Run(
        name=job.name,
        wall_seconds=round(float(wall), 1),
        peak_rss_mb=round(int(max_rss_kib) / 1024, 1),  # Linux reports KiB
        returncode=returncode,
        result=result,
        stdout=out_path,
        stderr=log_path,
    )


def json_at_end(text: str) -> Any:
    """The JSON document that ends ``text``: parsed from the last line that starts one."""
    lines = text.splitlines(keepends=True)
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith(("{", "[")):
            try:
                return json.loads("".join(lines[i:]))
            except json.JSONDecodeError:
                continue
    raise ValueError(f"no JSON document at the end of: {text[-300:]!r}")


def slug(name: str) -> str:
    """A file-name-safe form of a job name ("lmcompress:wanda:2:4" -> "lmcompress-wanda-2-4")."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "job"


def machine() -> dict[str, Any]:
    """What the numbers were measured on, stored next to them: CPU model and ISA flags, torch
    threads and ``OMP_NUM_THREADS``, versions (:mod:`lmcompress.evaluation.host`, in a process of
    its own with this environment: the threads a job's torch takes)."""
    command = (PYTHON, "-m", "lmcompress.evaluation.host")
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True)
    return json_at_end(done.stdout)


def _read(reads: str | Path | None, stdout: Path) -> Any:
    if reads is None:
        return None
    if reads == STDOUT:
        return json_at_end(stdout.read_text(errors="replace"))
    return json.loads(Path(reads).read_text())


def _tail(log_path: Path, chars: int = 3000) -> str:
    """The end of a job's stderr, and where the whole of it is."""
    return f"{log_path.read_text(errors='replace')[-chars:]}\n(whole log: {log_path})"
