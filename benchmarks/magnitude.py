"""Dense vs magnitude pruning (2:4, 4:8, 50% unstructured) of SmolLM2-135M.

    python -m benchmarks.magnitude [--eval-tokens 32768]
    python -m benchmarks.magnitude --only dense "magnitude 2:4"   # rerun rows, merge them
    python -m benchmarks.magnitude --render-only                  # redraw the md from the JSON

Every row of ``JOBS`` runs as its own process (``benchmarks.runner``), so wall time and peak RSS
are its own: model load, compression and evaluation of every corpus included. Writes
``benchmarks/results/magnitude.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.render import (
    add_harness_args,
    markdown_table,
    merge_rows,
    previous_rows,
    render_files,
    select_jobs,
    write_results,
)
from benchmarks.runner import PYTHON, STDOUT, Job, machine, run_job

log = logging.getLogger(__name__)

NAME = "magnitude"
CORPORA = ("wiki-test", "lee")
JOBS = [  # name, method (None: the dense model), sparsity
    {"name": "dense", "method": None},
    {"name": "magnitude 2:4", "method": "magnitude", "sparsity": "2:4"},
    {"name": "magnitude 4:8", "method": "magnitude", "sparsity": "4:8"},
    {"name": "magnitude 50%", "method": "magnitude", "sparsity": "0.5"},
]


def child(job: dict[str, Any]) -> dict[str, Any]:
    """One row, in its own process: load, compress (unless dense), score every corpus."""
    from lmcompress import compress
    from lmcompress.compressor.model.loading import load_model
    from lmcompress.evaluation.corpora import tokenize
    from lmcompress.evaluation.perplexity import perplexity
    from lmcompress.methods import get_method

    start = time.perf_counter()
    model, tokenizer = load_model(job["checkpoint"])
    result: dict[str, Any] = {"name": job["name"]}
    if job["method"]:
        config = get_method(job["method"]).config_class(sparsity=job["sparsity"])
        report = compress(model, config)
        result["compress_seconds"] = round(report.seconds, 2)
        result["summary"] = report.summary()
    for corpus in CORPORA:
        ids = tokenize(tokenizer, corpus, job["eval_tokens"] or None)
        result[corpus] = perplexity(model, ids, job["seq_len"], progress=False).to_dict()
    result["seconds"] = round(time.perf_counter() - start, 1)
    return result


def make_job(spec: dict[str, Any], settings: dict[str, Any]) -> Job:
    payload = json.dumps({**spec, **settings})
    return Job(spec["name"], (PYTHON, "-m", "benchmarks.magnitude", "--child", payload), STDOUT)


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
    header = ["model", *(f"{c} ppl" for c in CORPORA), "wall s (whole process)", "peak RSS MB"]
    return (
        f"SmolLM2-135M, every linear in the decoder blocks, seq-len {seq_len}, "
        f"scored tokens: {tokens}.\n\n" + markdown_table(header, rows)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="smollm2-135m")
    parser.add_argument("--eval-tokens", type=int, default=32768, help="per corpus, 0 = all")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    add_harness_args(parser, "rerun just these rows (names as in the table, e.g. dense)")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if args.render_only:
        print(render_files(args.results_dir, NAME, render))
        return 0
    names = select_jobs(parser, [j["name"] for j in JOBS], args.only)
    settings = {"checkpoint": args.checkpoint, "eval_tokens": args.eval_tokens}
    settings["seq_len"] = args.seq_len
    rows = previous_rows(args.results_dir, NAME, args.only)
    work = args.work or Path(tempfile.mkdtemp(prefix="lmcompress-magnitude-"))
    for spec in (j for j in JOBS if j["name"] in names):
        run = run_job(make_job(spec, settings), work)
        row = {**run.result, "peak_rss_mb": run.peak_rss_mb, "wall_seconds": run.wall_seconds}
        log.info("%s: %s", spec["name"], {c: row[c]["perplexity"] for c in CORPORA})
        rows = merge_rows(rows, [row], key=lambda r: r["name"], order=[j["name"] for j in JOBS])
    payload = {"settings": settings, "machine": machine(), "results": rows}
    print(write_results(args.results_dir, NAME, payload, render))
    log.info("job logs in %s", work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
