"""Dense vs magnitude pruning (2:4, 4:8, 50% unstructured) of SmolLM2-135M.

    python benchmarks/magnitude.py [--eval-tokens 32768]

Every configuration runs in its own process, so wall time and peak RSS are its own (model
load, compression and evaluation of every corpus included). Writes
``benchmarks/results/magnitude.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, markdown_table, peak_rss_mb, run_child, write_results  # noqa: E402

CORPORA = ("wiki-test", "lee")
JOBS = [
    {"name": "dense", "method": None},
    {"name": "magnitude 2:4", "method": "magnitude", "sparsity": "2:4"},
    {"name": "magnitude 4:8", "method": "magnitude", "sparsity": "4:8"},
    {"name": "magnitude 50%", "method": "magnitude", "sparsity": "0.5"},
]


def child(job: dict) -> dict:
    from lmcompress import compress
    from lmcompress.compressor.models import load_model
    from lmcompress.evaluation.corpora import tokenize
    from lmcompress.evaluation.perplexity import perplexity
    from lmcompress.methods import get_method

    start = time.perf_counter()
    model, tokenizer = load_model(job["checkpoint"])
    result = {"name": job["name"]}
    if job["method"]:
        config = get_method(job["method"]).config_class(sparsity=job["sparsity"])
        report = compress(model, config)
        result["compress_seconds"] = round(report.seconds, 2)
        result["summary"] = report.summary()
    for corpus in CORPORA:
        ids = tokenize(tokenizer, corpus, job["eval_tokens"] or None)
        result[corpus] = perplexity(model, ids, job["seq_len"], progress=False).to_dict()
    result["seconds"] = round(time.perf_counter() - start, 1)
    result["peak_rss_mb"] = peak_rss_mb()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="smollm2-135m")
    parser.add_argument("--eval-tokens", type=int, default=32768, help="per corpus, 0 = all")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "magnitude"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    common = {
        "checkpoint": args.checkpoint,
        "eval_tokens": args.eval_tokens,
        "seq_len": args.seq_len,
    }
    results = []
    for job in JOBS:
        print(f"running {job['name']} ...", file=sys.stderr)
        results.append(run_child(Path(__file__), {**job, **common}))
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
    table = (
        f"SmolLM2-135M, every linear in the decoder blocks, seq-len {args.seq_len}, "
        f"scored tokens: {tokens}.\n\n"
        + markdown_table(
            ["model", *(f"{c} ppl" for c in CORPORA), "wall s (whole process)", "peak RSS MB"], rows
        )
    )
    payload = {"settings": common, "machine": machine(), "results": results}
    write_results(Path(args.out), payload, table)
    print(table)


if __name__ == "__main__":
    main()
