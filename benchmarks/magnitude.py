"""Dense vs magnitude pruning (2:4, 4:8, 50% unstructured) of SmolLM2-135M.

    python -m benchmarks.magnitude [--eval-tokens 32768]
    python -m benchmarks.magnitude --only dense "magnitude 2:4"   # rerun rows, merge them
    python -m benchmarks.magnitude --render-only                  # redraw the md from the JSON

Every row of ``JOBS`` runs as its own process (``benchmarks.child.magnitude``, started by
``benchmarks.runner``), so wall time and peak RSS are its own: model load, compression and
evaluation of every corpus (the library's evaluate step) included. Writes
``benchmarks/results/magnitude.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from benchmarks.harness import add_harness_args, row_table, run_table
from benchmarks.render import markdown_table
from benchmarks.runner import PYTHON, STDOUT, Job, run_job

NAME = "magnitude"
CORPORA = ("wiki-test", "lee")
JOBS = [  # name, method (None: the dense model), sparsity
    {"name": "dense", "method": None},
    {"name": "magnitude 2:4", "method": "magnitude", "sparsity": "2:4"},
    {"name": "magnitude 4:8", "method": "magnitude", "sparsity": "4:8"},
    {"name": "magnitude 50%", "method": "magnitude", "sparsity": "0.5"},
]


def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    return {"checkpoint": args.checkpoint, "eval_tokens": args.eval_tokens, "seq_len": args.seq_len}


def run_row(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One row, a process of its own (``benchmarks.child.magnitude``)."""
    spec = next(j for j in JOBS if j["name"] == name)
    job = json.dumps({**spec, **settings_of(args), "corpora": CORPORA})
    command = (PYTHON, "-m", "benchmarks.child.magnitude", job)
    run = run_job(Job(name, command, STDOUT), args.work)
    return {**run.result, "peak_rss_mb": run.peak_rss_mb, "wall_seconds": run.wall_seconds}


def record(args: argparse.Namespace, rows: list[dict]) -> dict[str, Any]:
    return {"settings": settings_of(args), "results": rows}


def render(payload: dict[str, Any]) -> str:
    results, seq_len = payload["results"], payload["settings"]["seq_len"]
    rows = [
        [
            r["name"],
            *(f"{r[c]['perplexity']:.2f}" for c in CORPORA),
            r["wall_seconds"],
            r["peak_rss_mb"],
        ]
        for r in results
    ]
    tokens = ", ".join(f"{c} {results[0][c]['tokens']}" for c in CORPORA)
    header = ["model", *(f"{c} ppl" for c in CORPORA), "wall s (whole process)", "peak RSS MiB"]
    return (
        f"SmolLM2-135M, every linear in the decoder blocks, seq-len {seq_len}, "
        f"scored tokens: {tokens}.\n\n" + markdown_table(header, rows)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="smollm2-135m")
    parser.add_argument("--eval-tokens", type=int, default=32768, help="per corpus, 0 = all")
    parser.add_argument("--seq-len", type=int, default=512)
    add_harness_args(parser, "rerun just these rows (names as in the table, e.g. dense)")
    table = row_table(NAME, render, [j["name"] for j in JOBS], run_row, record)
    return run_table(table, parser.parse_args(argv), parser)


if __name__ == "__main__":
    sys.exit(main())
