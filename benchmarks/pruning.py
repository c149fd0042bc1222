"""One-shot pruning of SmolLM2-135M, ours next to llm-compressor's, on the same job.

    python benchmarks/pruning.py [--eval-tokens 32768] [--skip-peers]

For magnitude, Wanda and SparseGPT at 2:4 and 50 % unstructured: our ``compress-model`` and
(for Wanda and SparseGPT) llm-compressor 0.14.0.1's ``oneshot`` in its own venv
(``benchmarks/peers/setup_llmcompressor.sh``) prune every linear in the decoder blocks with the
same 128 calibration windows of 512 tokens from ``wiki-calib`` (seed 0). Each compression runs
as its own process under ``/usr/bin/time -v`` (load, calibrate, prune, save: wall time and peak
RSS of the whole process). Every output directory is then scored by the same ``compress-model
eval`` on ``wiki-test`` and ``lee`` (seq-len 512). Writes ``benchmarks/results/pruning.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "peers"))
from common import ROOT, machine, markdown_table, write_results  # noqa: E402
from run_peer import DEFAULT_VENV, parse_time_v, run_peer  # noqa: E402

CORPORA = ("wiki-test", "lee")
JOBS = [  # (method, sparsity, tools)
    ("magnitude", "2:4", ("lmcompress",)),
    ("wanda", "2:4", ("lmcompress", "llm-compressor")),
    ("sparsegpt", "2:4", ("lmcompress", "llm-compressor")),
    ("magnitude", "0.5", ("lmcompress",)),
    ("wanda", "0.5", ("lmcompress", "llm-compressor")),
    ("sparsegpt", "0.5", ("lmcompress", "llm-compressor")),
]
CLI = [sys.executable, "-m", "lmcompress.cli.main"]


def timed(cmd: list[str]) -> tuple[float, float]:
    """Run ``cmd`` under GNU time; (wall seconds, peak RSS MiB)."""
    proc = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return parse_time_v(proc.stderr)


def score(path: str, eval_tokens: int) -> dict:
    cmd = [
        *CLI,
        "eval",
        path,
        "--data",
        *CORPORA,
        "--eval-tokens",
        str(eval_tokens),
        "--json",
        "-q",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"eval of {path} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout)["perplexity"]


def ours(method: str, sparsity: str, out: Path, args: argparse.Namespace) -> dict:
    cmd = [
        *CLI,
        args.checkpoint,
        "--method",
        method,
        "--sparsity",
        sparsity,
        "--calib",
        "wiki-calib",
        "--nsamples",
        str(args.nsamples),
        "--seq-len",
        str(args.seq_len),
        "--seed",
        "0",
        "--eval",
        "-o",
        str(out),
        "-q",
    ]
    wall, rss = timed(cmd)
    return {"wall_seconds": round(wall, 1), "peak_rss_mb": round(rss, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="smollm2-135m")
    parser.add_argument("--eval-tokens", type=int, default=32768, help="per corpus, 0 = all")
    parser.add_argument("--nsamples", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--skip-peers", action="store_true")
    parser.add_argument("--venv", default=str(DEFAULT_VENV), help="llm-compressor's venv")
    parser.add_argument("--out", default=str(HERE / "results" / "pruning"))
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="TOOL:METHOD:SPARSITY",
        help="rerun just these rows (e.g. lmcompress:wanda:2:4) and update them in --out.json",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    log = logging.getLogger("pruning")
    if not args.skip_peers and not (Path(args.venv) / "bin" / "python").exists():
        subprocess.run(
            ["bash", str(HERE / "peers" / "setup_llmcompressor.sh"), args.venv], check=True
        )

    work = Path(tempfile.mkdtemp(prefix="lmcompress-bench-"))
    previous = Path(args.out).with_suffix(".json")
    if args.only:  # keep every other row of the last full run
        results = json.loads(previous.read_text())["results"]
    else:
        results = [
            {
                "method": "dense",
                "sparsity": "-",
                "tool": "-",
                "ppl": score(args.checkpoint, args.eval_tokens),
            }
        ]
    try:
        for method, sparsity, tools in JOBS:
            for tool in tools:
                if tool == "llm-compressor" and args.skip_peers:
                    continue
                if args.only and f"{tool}:{method}:{sparsity}" not in args.only:
                    continue
                log.info("%s %s %s", tool, method, sparsity)
                out = work / f"{tool}-{method}-{sparsity.replace(':', 'of')}"
                if tool == "lmcompress":
                    run = ours(method, sparsity, out, args)
                else:
                    peer = run_peer(
                        method,
                        sparsity,
                        out,
                        nsamples=args.nsamples,
                        seq_len=args.seq_len,
                        venv=args.venv,
                        checkpoint=args.checkpoint,
                    )
                    run = {k: round(peer[k], 1) for k in ("wall_seconds", "peak_rss_mb")}
                run.update(
                    method=method,
                    sparsity=sparsity,
                    tool=tool,
                    ppl=score(str(out), args.eval_tokens),
                )
                key = (tool, method, sparsity)
                results = [r for r in results if (r["tool"], r["method"], r["sparsity"]) != key]
                results.append(run)
                log.info("%s", run)
                shutil.rmtree(out, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    order = {(m, sp): i for i, (m, sp, _) in enumerate(JOBS)}
    results.sort(
        key=lambda r: (order.get((r["method"], r["sparsity"]), -1), r["tool"] == "llm-compressor")
    )
    settings = {k: getattr(args, k) for k in ("checkpoint", "eval_tokens", "nsamples", "seq_len")}
    payload = {"settings": settings, "machine": machine(), "results": results}
    write_results(Path(args.out), payload, render(results, settings))
    print(render(results, settings))


def _ratio(ours: dict, peer: dict | None, key: str) -> str:
    return f"{ours[key] / peer[key]:.2f}" if peer else "-"


def render(results: list[dict], settings: dict) -> str:
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
    return head + markdown_table(
        [
            "method",
            "sparsity",
            "tool",
            *(f"{c} ppl" for c in CORPORA),
            "wall s",
            "peak RSS MB",
            "ppl ratio (wiki-test)",
            "wall ratio",
            "RSS ratio",
        ],
        rows,
    )


if __name__ == "__main__":
    main()
