"""Compressed runtimes on SmolLM2-135M: compress, then reload the output in each runtime.

    python -m benchmarks.runtime                           # every row
    python -m benchmarks.runtime --only "svd 0.8"          # rerun rows, merge them
    python -m benchmarks.runtime --render-only             # redraw the md from the JSON

Each row is three processes (``benchmarks.runner``): ``compress-model`` compresses, scores the
compressed fp32 model on wiki-test and lee and saves at bf16; then ``compress-model eval OUT
--runtime packed`` and ``--runtime dense`` reload the output (by replay: compressed modules from
the stored tensors, ``PackedNMLinear`` / ``LowRankLinear``, or plain linears rebuilt from them)
and score it again. The eval's ``--json`` reports the bytes the compressed layers hold and the
peak RSS right after loading. The ``main job`` row runs the README's first command with an empty
cache (GGUF conversion and corpus cleaning included), as a newcomer would.
Writes ``benchmarks/results/runtime.{json,md}``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.harness import add_harness_args, row_table, run_table
from benchmarks.render import markdown_table
from benchmarks.runner import CLI, STDOUT, Job, run_job

NAME = "runtime"
CORPORA = ("wiki-test", "lee")
RUNTIMES = ("packed", "dense")
MAIN_JOB = ("--method", "sparsegpt", "--sparsity", "2:4", "--nsamples", "64")  # README's
JOBS = [  # name, compress-model flags of the compression
    {"name": "sparsegpt 2:4", "flags": ("--method", "sparsegpt", "--sparsity", "2:4")},
    {"name": "magnitude 2:4", "flags": ("--method", "magnitude", "--sparsity", "2:4")},
    {"name": "svd 0.8", "flags": ("--method", "svd", "--ratio", "0.8")},
    {"name": "main job", "flags": MAIN_JOB},
]


def compress_job(spec: dict[str, Any], out: Path, settings: dict[str, Any]) -> Job:
    common = ("--eval-tokens", str(settings["eval_tokens"]), "-o", str(out), "-q")
    if spec["name"] == "main job":  # exactly the README's command, from an empty cache
        cache = tempfile.mkdtemp(prefix="lmcompress-cache-")
        return Job(
            spec["name"],
            (*CLI, *spec["flags"], *common),
            out / "compression.json",
            env={"LMCOMPRESS_CACHE": cache},
        )
    command = (*CLI, settings["checkpoint"], *spec["flags"], "--eval", *CORPORA, "--skip-dense")
    return Job(
        spec["name"], (*command, "--save-dtype", "bfloat16", *common), out / "compression.json"
    )


def eval_job(name: str, out: Path, runtime: str, settings: dict[str, Any]) -> Job:
    command = (*CLI, "eval", str(out), "--runtime", runtime, "--data", *CORPORA)
    tokens = ("--eval-tokens", str(settings["eval_tokens"]))
    return Job(f"{name} {runtime}", (*command, *tokens, "--json", "-q"), STDOUT)


def run_row(name: str, args: argparse.Namespace) -> dict[str, Any]:
    spec = next(j for j in JOBS if j["name"] == name)
    settings, work = settings_of(args), args.work
    out = work / "outputs" / spec["name"].replace(" ", "-").replace(":", "of")
    run = run_job(compress_job(spec, out, settings), work)
    results = run.result["results"]
    row: dict[str, Any] = {
        "name": spec["name"],
        "command": "compress-model " + " ".join(spec["flags"]),
        "wall_seconds": run.wall_seconds,
        "peak_rss_mb": run.peak_rss_mb,
        "compressed": {c: results["compressed"][c]["perplexity"] for c in results["compressed"]},
        "summary": run.result["report"]["summary"],
    }
    if "dense" in results:
        row["dense"] = {c: results["dense"][c]["perplexity"] for c in results["dense"]}
    if spec["name"] == "main job":
        return row
    for runtime in RUNTIMES:
        reloaded = run_job(eval_job(spec["name"], out, runtime, settings), work)
        result = reloaded.result
        row[runtime] = {
            "perplexity": {c: result["perplexity"][c]["perplexity"] for c in CORPORA},
            "load": result["load"],
            "process_peak_rss_mb": reloaded.peak_rss_mb,
            "wall_seconds": reloaded.wall_seconds,
        }
    return row


def render(payload: dict[str, Any]) -> str:
    rows, main_rows = [], []
    for r in payload["results"]:
        if r["name"] == "main job":
            main_rows.append(
                [
                    f"`{r['command']}`",
                    f"{r['dense']['wiki-test']:.2f}",
                    f"{r['compressed']['wiki-test']:.2f}",
                    r["wall_seconds"],
                    r["peak_rss_mb"],
                ]
            )
            continue
        kept = r["summary"]["params_kept"] / r["summary"]["params_compressed_layers"]
        for runtime in RUNTIMES:
            got = r[runtime]
            rows.append(
                [
                    r["name"],
                    f"{kept:.3f}",
                    r["wall_seconds"],
                    r["peak_rss_mb"],
                    *(f"{r['compressed'][c]:.2f}" for c in CORPORA),
                    runtime,
                    *(f"{got['perplexity'][c]:.2f}" for c in CORPORA),
                    f"{got['load']['resident_bytes'] / 2**20:.1f}",
                    f"{got['load']['ratio_to_dense_fp16']:.4f}",
                    got["load"]["peak_rss_mib"],
                    got["process_peak_rss_mb"],
                ]
            )
    header = [
        "method",
        "params kept",
        "compress wall s",
        "compress peak RSS MiB",
        *(f"{c} ppl (fp32, in process)" for c in CORPORA),
        "runtime",
        *(f"{c} ppl (bf16 reload)" for c in CORPORA),
        "compressed layers MiB",
        "÷ dense fp16",
        "peak RSS after load MiB",
        "eval process peak RSS MiB",
    ]
    settings = payload["settings"]
    text = (
        f"SmolLM2-135M ({settings['checkpoint']}), every linear in the decoder blocks; "
        f"perplexity at seq-len 512 over the first {settings['eval_tokens']} tokens. Each method "
        "compresses in fp32 (scored in that process; wall and peak RSS: that whole process, "
        "evaluation included) and saves at bf16; each runtime reloads "
        "the saved directory in its own process. Compressed-layer bytes: the tensors the "
        "compressed layers hold after loading (bias excluded), against their dense fp16 "
        "weights.\n\n" + markdown_table(header, rows)
    )
    if main_rows:
        text += (
            "\nThe README's main job from an empty cache (GGUF conversion, corpus cleaning, "
            "dense and pruned evaluation on wiki-test, export; set-up not included):\n\n"
            + markdown_table(
                [
                    "command",
                    "dense wiki-test ppl",
                    "pruned wiki-test ppl",
                    "wall s",
                    "peak RSS MiB",
                ],
                main_rows,
            )
        )
    return text


def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    return {"checkpoint": args.checkpoint, "eval_tokens": args.eval_tokens}


def record(args: argparse.Namespace, rows: list[dict]) -> dict[str, Any]:
    return {"settings": settings_of(args), "results": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="smollm2-135m")
    parser.add_argument("--eval-tokens", type=int, default=32768, help="per corpus, 0 = all")
    add_harness_args(parser, "rerun just these rows (names as in the table, e.g. 'svd 0.8')")
    table = row_table(NAME, render, [j["name"] for j in JOBS], run_row, record)
    return run_table(table, parser.parse_args(argv), parser)


if __name__ == "__main__":
    sys.exit(main())
