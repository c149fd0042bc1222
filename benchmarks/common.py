"""Helpers shared by the benchmark scripts: run one job in a child process (so its wall time
and peak RSS are its own), and write results as JSON and a markdown table."""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def run_child(script: Path, job: dict[str, Any]) -> dict[str, Any]:
    """Run ``script --child JOB_JSON``; the child prints its result as the last stdout line."""
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(script), "--child", json.dumps(job)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "TQDM_DISABLE": "1"},
    )
    if proc.returncode != 0:
        raise RuntimeError(f"job {job} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["wall_seconds"] = round(time.perf_counter() - start, 1)
    return result


def peak_rss_mb() -> float:
    """Peak resident set size of this process (Linux reports KiB)."""
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def machine() -> dict[str, Any]:
    import torch
    import transformers

    return {
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def write_results(out_stem: Path, payload: dict[str, Any], table: str) -> None:
    out_stem.parent.mkdir(parents=True, exist_ok=True)
    out_stem.with_suffix(".json").write_text(json.dumps(payload, indent=2) + "\n")
    out_stem.with_suffix(".md").write_text(table)


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"
