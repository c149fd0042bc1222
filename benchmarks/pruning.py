"""One-shot pruning of SmolLM2-135M, ours next to llm-compressor's, on the same job.

    python -m benchmarks.pruning [--eval-tokens 32768] [--skip-peers]
    python -m benchmarks.pruning --only lmcompress:wanda:2:4    # rerun rows, merge them
    python -m benchmarks.pruning --render-only                  # redraw the md from the JSON

For magnitude, Wanda and SparseGPT at 2:4 and 50 % unstructured: our ``compress-model`` and
(for Wanda and SparseGPT) llm-compressor 0.14.0.1's ``oneshot`` in its own venv
(``benchmarks/peers/setup_llmcompressor.sh``) prune every linear in the decoder blocks with the
same 128 calibration windows of 512 tokens from ``wiki-calib`` (seed 0). Each compression runs
as its own process (``benchmarks.runner``: load, calibrate, prune, save: wall time and peak RSS
of the whole process). Every output directory is then scored by the same ``compress-model eval
--json`` (a job of its own) on ``wiki-test`` and ``lee`` (seq-len 512); ``dense`` scores the
checkpoint itself. Job names: ``dense`` and ``TOOL:METHOD:SPARSITY``. Writes
``benchmarks/results/pruning.{json,md}``.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.harness import add_harness_args, row_table, run_table
from benchmarks.peers.run_peer import DEFAULT_VENV, run_peer
from benchmarks.render import markdown_table
from benchmarks.runner import CLI, STDOUT, Job, run_job

NAME = "pruning"
HERE = Path(__file__).resolve().parent
CORPORA = ("wiki-test", "lee")
JOBS = [  # (method, sparsity, tools); a job per tool, after the dense row
    ("magnitude", "2:4", ("lmcompress",)),
    ("wanda", "2:4", ("lmcompress", "llm-compressor")),
    ("sparsegpt", "2:4", ("lmcompress", "llm-compressor")),
    ("magnitude", "0.5", ("lmcompress",)),
    ("wanda", "0.5", ("lmcompress", "llm-compressor")),
    ("sparsegpt", "0.5", ("lmcompress", "llm-compressor")),
]


def job_name(tool: str, method: str, sparsity: str) -> str:
    return "dense" if method == "dense" else f"{tool}:{method}:{sparsity}"


def row_name(row: dict[str, Any]) -> str:
    return job_name(row["tool"], row["method"], row["sparsity"])


JOB_NAMES = ["dense"] + [job_name(t, m, s) for m, s, tools in JOBS for t in tools]


def compress_job(method: str, sparsity: str, out: Path, args: argparse.Namespace) -> Job:
    """Our side: ``compress-model`` with the peer's calibration, saving to ``out``."""
    command = (
        *CLI, args.checkpoint, "--method", method, "--sparsity", sparsity,
        "--calib", "wiki-calib", "--nsamples", str(args.nsamples), "--seq-len", str(args.seq_len),
        "--seed", "0", "--eval", "-o", str(out), "-q",
    )  # fmt: skip
    return Job(job_name("lmcompress", method, sparsity), command)


def score_job(name: str, path: str | Path, eval_tokens: int) -> Job:
    """The same scoring for every row: ``compress-model eval PATH --json``."""
    command = (*CLI, "eval", str(path), "--data", *CORPORA, "--eval-tokens", str(eval_tokens))
    return Job(f"eval {name}", (*command, "--json", "-q"), STDOUT)


def run_row(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One row of the table: compress (ours or the peer's), then score the output."""
    work = args.work
    if name == "dense":
        ppl = run_job(score_job(name, args.checkpoint, args.eval_tokens), work).result
        return {"method": "dense", "sparsity": "-", "tool": "-", "ppl": ppl["perplexity"]}
    tool, method, sparsity = name.split(":", 2)
    out = work / f"{tool}-{method}-{sparsity.replace(':', 'of')}"
    if tool == "lmcompress":
        run = run_job(compress_job(method, sparsity, out, args), work)
        row = {"wall_seconds": run.wall_seconds, "peak_rss_mb": run.peak_rss_mb}
    else:
        if not (Path(args.venv) / "bin" / "python").exists():
            setup = HERE / "peers" / "setup_llmcompressor.sh"
            subprocess.run(["bash", str(setup), args.venv], check=True)
        peer = run_peer(
            method,
            sparsity,
            out,
            nsamples=args.nsamples,
            seq_len=args.seq_len,
            venv=args.venv,
            checkpoint=args.checkpoint,
        )
        row = {k: round(peer[k], 1) for k in ("wall_seconds", "peak_rss_mb")}
    ppl = run_job(score_job(name, out, args.eval_tokens), work).result["perplexity"]
    shutil.rmtree(out, ignore_errors=True)
    return {**row, "method": method, "sparsity": sparsity, "tool": tool, "ppl": ppl}


def record(args: argparse.Namespace, rows: list[dict]) -> dict[str, Any]:
    settings = {k: getattr(args, k) for k in ("checkpoint", "eval_tokens", "nsamples", "seq_len")}
    return {"settings": settings, "results": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="smollm2-135m")
    parser.add_argument("--eval-tokens", type=int, default=32768, help="per corpus, 0 = all")
    parser.add_argument("--nsamples", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument(
        "--skip-peers",
        action="store_true",
        help="run none of llm-compressor's rows (those of the results file are kept)",
    )
    parser.add_argument("--venv", default=str(DEFAULT_VENV), help="llm-compressor's venv")
    add_harness_args(parser, "rerun just these rows (dense, or TOOL:METHOD:SPARSITY)")
    args = parser.parse_args(argv)
    if args.skip_peers:
        args.only = [n for n in args.only or JOB_NAMES if not n.startswith("llm-compressor:")]
        if not args.only:
            parser.error("--skip-peers leaves no job to run")
    table = row_table(NAME, render, JOB_NAMES, run_row, record, key=row_name)
    return run_table(table, args, parser)


def _ratio(ours: dict, peer: dict | None, key: str) -> str:
    return f"{ours[key] / peer[key]:.2f}" if peer else "-"


def render(payload: dict[str, Any]) -> str:
    results, settings = payload["results"], payload["settings"]
    peers = {(r["method"], r["sparsity"]): r for r in results if r["tool"] == "llm-compressor"}
    rows = []
    for r in results:
        peer = peers.get((r["method"], r["sparsity"])) if r["tool"] == "lmcompress" else None
        ppl_ratio = (
            f"{r['ppl']['wiki-test']['perplexity'] / peer['ppl']['wiki-test']['perplexity']:.3f}"
            if peer
            else "-"
        )
        rows.append(
            [
                r["method"],
                r["sparsity"],
                r["tool"],
                *(f"{r['ppl'][c]['perplexity']:.2f}" for c in CORPORA),
                r.get("wall_seconds", "-"),
                r.get("peak_rss_mb", "-"),
                ppl_ratio,
                _ratio(r, peer, "wall_seconds"),
                _ratio(r, peer, "peak_rss_mb"),
            ]
        )
    tokens = ", ".join(f"{c} {results[0]['ppl'][c]['tokens']}" for c in CORPORA)
    head = (
        f"SmolLM2-135M, every linear in the decoder blocks; calibration {settings['nsamples']} × "
        f"{settings['seq_len']} tokens of wiki-calib (seed 0); perplexity at seq-len "
        f"{settings['seq_len']} over {tokens} scored tokens. Wall time and peak RSS: the whole "
        "compression process (load, calibrate, prune, save), not the evaluation. Ratios: ours / "
        "llm-compressor's.\n\n"
    )
    header = [
        "method",
        "sparsity",
        "tool",
        *(f"{c} ppl" for c in CORPORA),
        "wall s",
        "peak RSS MiB",
        "ppl ratio (wiki-test)",
        "wall ratio",
        "RSS ratio",
    ]
    return head + markdown_table(header, rows)


if __name__ == "__main__":
    sys.exit(main())
