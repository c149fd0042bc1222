"""Bad and hostile inputs to ``compress-model`` on the real model, as a new user would try them.

    python -m benchmarks.bad_inputs                        # every probe
    python -m benchmarks.bad_inputs --only "--seq-len 100000"
    python -m benchmarks.bad_inputs --render-only

Each probe runs the installed CLI in a process of its own, in an empty directory, and records
its exit code, wall time, how many lines it printed on stderr, its last stderr line, and what it
left in the directory (or next to its output). The kill probes start a real job, wait until its
output's temporary sibling appears (the save has begun), send SIGKILL or SIGTERM, then (SIGKILL)
run the same job again. Writes ``benchmarks/results/bad_inputs.{json,md}``; the probes are the
rows of issue 10's table.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import add_harness_args, row_table, run_table
from benchmarks.render import markdown_table
from benchmarks.runner import CLI
from lmcompress.compressor.util.cache import cache_dir

NAME = "bad_inputs"
QUICK = ("--method", "magnitude", "--eval", "--skip-dense")  # the cheapest real job

# name -> (compress-model argv, files to create first {relative path: text})
PROBES: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {
    "--device cuda": (("--device", "cuda", "-o", "out"), {}),
    "recipe nsamples: many": (("--config", "r.yaml", "-o", "out"), {"r.yaml": "nsamples: many\n"}),
    "recipe blocksize: big": (
        ("--config", "r.yaml", "-o", "out"),
        {"r.yaml": "method: sparsegpt\nblocksize: big\n"},
    ),
    "recipe eval: wiki-test": (
        ("--config", "r.yaml", "-o", "out"),
        {"r.yaml": "eval: wiki-test\n"},
    ),
    "-o under /proc": (("-o", "/proc/lmcompress-out"), {}),
    "-o under a file": (("-o", "a-file/out"), {"a-file": "x"}),
    "-o on a read-only mount": (("-o", "ro/out"), {}),
    "--nsamples 100000": (("--method", "sparsegpt", "--nsamples", "100000", "-o", "out"), {}),
    "--seq-len 100000": (("--seq-len", "100000", "-o", "out"), {}),
    "--overwrite -o the input": (("--overwrite", "-o", "{cache}"), {}),
    "--layer-sparsity nomatch": (("--layer-sparsity", "nomatch.*=0.3", "-o", "out"), {}),
    "maskllm --resume, empty dir": (
        ("--method", "maskllm", "--resume", "--checkpoint-dir", "ckpt", "-o", "out"),
        {"ckpt/.keep": ""},
    ),
    "maskllm --steps 0": (("--method", "maskllm", "--steps", "0", "-o", "out"), {}),
    "--lm-eval-tasks nonexistent_task": (
        ("--lm-eval-tasks", "nonexistent_task", "-o", "out"),
        {},
    ),
    "hub id, offline": (("some-org/some-model", "-o", "out"), {}),
    "missing checkpoint": (("./no-such-model", "-o", "out"), {}),
}
KILLS = ("SIGKILL while saving", "SIGTERM while saving")
MODES = "exported file modes"
ORDER = [*PROBES, *KILLS, MODES]


def _cache() -> Path:
    return cache_dir() / "smollm2-135m"


def _fingerprint(path: Path) -> str:
    """Names, sizes and mtimes of everything under ``path``: did anything change?"""
    digest = hashlib.sha256()
    for item in sorted(path.rglob("*")):
        stat = item.stat()
        digest.update(f"{item.relative_to(path)} {stat.st_size} {stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def _listing(work: Path) -> list[str]:
    return sorted(str(p.relative_to(work)) for p in work.rglob("*"))


def _run(argv: tuple[str, ...], work: Path) -> tuple[int, float, str]:
    start = time.perf_counter()
    done = subprocess.run([*CLI, *argv], cwd=work, capture_output=True, text=True, check=False)
    return done.returncode, time.perf_counter() - start, done.stderr


def _row(name: str, code: int, seconds: float, stderr: str, left: list[str]) -> dict[str, Any]:
    lines = [line for line in stderr.splitlines() if line.strip()]
    return {
        "name": name,
        "exit": code,
        "seconds": round(seconds, 1),
        "stderr_lines": len(lines),
        "message": lines[-1] if lines else "",
        "left_behind": left,
    }


def run_probe(name: str, work: Path) -> dict[str, Any]:
    argv, files = PROBES[name]
    work.mkdir(parents=True)
    for rel, text in files.items():
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        (work / rel).write_text(text)
    mounted = False
    if name == "-o on a read-only mount":
        (work / "ro").mkdir()
        mounted = (
            subprocess.run(["mount", "-o", "bind,ro", "ro", "ro"], cwd=work, check=False)
        ).returncode == 0
        if not mounted:
            return {"name": name, "skipped": "cannot bind-mount read-only here (needs root)"}
    argv = tuple(a.format(cache=_cache()) for a in argv)
    before, cache_before = _listing(work), _fingerprint(_cache())
    try:
        code, seconds, stderr = _run(argv, work)
    finally:
        if mounted:
            subprocess.run(["umount", str(work / "ro")], check=False)
    left = sorted(set(_listing(work)) - set(before))
    if _fingerprint(_cache()) != cache_before:
        left.append(f"the input {_cache()} changed")
    return _row(name, code, seconds, stderr, left)


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
    row = _row(name, proc.returncode, time.perf_counter() - start, stderr, _listing(work))
    if sig == signal.SIGKILL:  # nothing can clean up after SIGKILL: the next run must
        code, seconds, again = _run((*argv, "-q"), work)
        row["next_run"] = {
            "exit": code,
            "seconds": round(seconds, 1),
            "warned": [line for line in again.splitlines() if "stale" in line],
            "left_behind": [p for p in _listing(work) if not p.startswith("out")],
        }
    return row


def run_modes(work: Path) -> dict[str, Any]:
    work.mkdir(parents=True)
    code, seconds, stderr = _run((*QUICK, "-o", "out", "-q"), work)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in sorted((work / "out").iterdir())}
    row = _row(MODES, code, seconds, stderr, [])
    umask = os.umask(0)
    os.umask(umask)
    row["umask"] = oct(umask)
    row["modes"] = modes
    # what the output weighs with and without the dense copy (fp32, the model's own dtype)
    _run((*QUICK, "--no-dense-copy", "-o", "lean", "-q"), work)
    row["sizes_mb"] = {
        out: {p.name: round(p.stat().st_size / 1e6, 1) for p in sorted((work / out).iterdir())}
        for out in ("out", "lean")
    }
    return row


def render(payload: dict[str, Any]) -> str:
    rows = []
    for r in payload["results"]:
        if "skipped" in r:
            rows.append([f"`{r['name']}`", "-", "-", "-", f"skipped: {r['skipped']}", "-"])
            continue
        left = ", ".join(r["left_behind"]) or "nothing"
        message = r["message"].replace("|", "\\|")
        if "next_run" in r:
            nxt = r["next_run"]
            message += (
                f"; next run: exit {nxt['exit']}, {' '.join(nxt['warned']) or 'no warning'}, "
                f"left {', '.join(nxt['left_behind']) or 'nothing'}"
            )
        if "modes" in r:
            message = f"umask {r['umask']}: " + ", ".join(f"{k} {v}" for k, v in r["modes"].items())
            left = "-"
            for out, files in r.get("sizes_mb", {}).items():
                big = {k: v for k, v in files.items() if v >= 1}
                message += (
                    f"; {'default' if out == 'out' else '--no-dense-copy'} output "
                    f"{sum(files.values()):.1f} MB ("
                    + ", ".join(f"{k} {v}" for k, v in big.items())
                    + ")"
                )
        rows.append([f"`{r['name']}`", r["exit"], r["seconds"], r["stderr_lines"], message, left])
    header = ["input", "exit", "s", "stderr lines", "last stderr line", "left behind"]
    return "# Bad inputs on SmolLM2-135M (`python -m benchmarks.bad_inputs`)\n\n" + markdown_table(
        header, rows
    )


def run_row(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One probe, in an empty directory of its own under ``args.work``."""
    where = args.work / f"probe-{ORDER.index(name):02d}"
    if name in PROBES:
        return run_probe(name, where)
    if name in KILLS:
        return run_kill(name, where)
    return run_modes(where)


def record(_args: argparse.Namespace, rows: list[dict]) -> dict[str, Any]:
    return {"results": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_harness_args(parser, "rerun just these probes (names as in the table)")
    table = row_table(NAME, render, ORDER, run_row, record)
    return run_table(table, parser.parse_args(argv), parser)


if __name__ == "__main__":
    sys.exit(main())
