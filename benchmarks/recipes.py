"""A two-stage recipe beside each of its stages alone, on SmolLM2-135M.

    python -m benchmarks.recipes                        # every row
    python -m benchmarks.recipes --only "sparsegpt 2:4 -> int8"
    python -m benchmarks.recipes --render-only          # redraw the md from the JSON

Each row is one ``compress-model`` process (``benchmarks.runner``: wall time and peak RSS of
the whole job, dense and compressed evaluation included): SparseGPT 2:4 alone, int8 (W8A8,
dynamic activations) alone, and ``recipes/sparsegpt24-int8.yaml``, the two in one job, whose
layers are stored as 2:4-packed int8 codes (``nm_packed_int8``). Same calibration (32 × 512
tokens of wiki-calib) and evaluation (wiki-test and lee, seq-len 512) everywhere; outputs
written without the dense copy. Compressed-layer bytes: what the report counts for the stored
form of the compressed layers (values and metadata: positions, scales), and the size of
``compressed.safetensors``. Writes ``benchmarks/results/recipes.{json,md}``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from benchmarks.harness import add_harness_args, row_table, run_table
from benchmarks.render import markdown_table
from benchmarks.runner import CLI, Job, run_job

NAME = "recipes"
CORPORA = ("wiki-test", "lee")
RECIPE = "recipes/sparsegpt24-int8.yaml"
JOBS = [  # name, compress-model flags
    {"name": "sparsegpt 2:4", "flags": ("--method", "sparsegpt", "--sparsity", "2:4")},
    {"name": "int8", "flags": ("--method", "int8")},
    {"name": "sparsegpt 2:4 -> int8", "flags": ("--config", RECIPE)},
]


def compress_job(spec: dict[str, Any], out: Path, settings: dict[str, Any]) -> Job:
    command = (
        *CLI,
        *spec["flags"],
        settings["checkpoint"],
        "--nsamples",
        "32",
        "--eval",
        *CORPORA,
        "--eval-tokens",
        str(settings["eval_tokens"]),
        "--no-dense-copy",
        "-o",
        str(out),
        "-q",
    )
    return Job(spec["name"], command, out / "compression.json")


def run_row(name: str, args: argparse.Namespace) -> dict[str, Any]:
    spec = next(j for j in JOBS if j["name"] == name)
    settings, work = settings_of(args), args.work
    out = work / "outputs" / spec["name"].replace(" ", "-").replace(":", "of").replace(">", "")
    run = run_job(compress_job(spec, out, settings), work)
    results = run.result["results"]
    row: dict[str, Any] = {
        "name": spec["name"],
        "command": "compress-model " + " ".join(spec["flags"]),
        "wall_seconds": run.wall_seconds,
        "peak_rss_mb": run.peak_rss_mb,
        "dense": {c: results["dense"][c]["perplexity"] for c in results["dense"]},
        "compressed": {c: results["compressed"][c]["perplexity"] for c in results["compressed"]},
        "summary": run.result["report"]["summary"],
        "formats": sorted({e["format"] for e in run.result["compressed_layers"].values()}),
        "compressed_file_bytes": (out / "compressed.safetensors").stat().st_size,
    }
    if results.get("stages"):
        row["stages"] = [
            {
                "method": stage["method"],
                "compressed": {c: r["perplexity"] for c, r in stage["compressed"].items()},
                "seconds": round(stage["seconds"], 1),
            }
            for stage in results["stages"]
        ]
    return row


def render(payload: dict[str, Any]) -> str:
    rows = []
    for r in payload["results"]:
        summary = r["summary"]
        rows.append(
            [
                r["name"],
                ", ".join(r["formats"]),
                *(f"{r['compressed'][c]:.3f}" for c in CORPORA),
                f"{summary['bytes_compressed'] / 2**20:.1f}",
                f"{summary['bytes_compressed'] / summary['bytes_dense']:.4f}",
                f"{r['compressed_file_bytes'] / 2**20:.1f}",
                r["wall_seconds"],
                r["peak_rss_mb"],
            ]
        )
        for index, stage in enumerate(r.get("stages", [])[:-1], 1):
            rows.append(
                [
                    f"↳ after stage {index} ({stage['method']})",
                    "",
                    *(f"{stage['compressed'][c]:.3f}" for c in CORPORA),
                    "",
                    "",
                    "",
                    "",
                    "",
                ]
            )
    dense = payload["results"][0]["dense"] if payload["results"] else {}
    header = [
        "job",
        "stored format",
        *(f"{c} ppl" for c in CORPORA),
        "compressed layers MiB",
        "÷ dense fp32",
        "compressed.safetensors MiB",
        "wall s",
        "peak RSS MiB",
    ]
    settings = payload["settings"]
    return (
        f"SmolLM2-135M ({settings['checkpoint']}), every linear in the decoder blocks; "
        "calibration 32 × 512 tokens of wiki-calib; perplexity at seq-len 512 over the first "
        f"{settings['eval_tokens']} tokens of each corpus (dense: "
        + ", ".join(f"{c} {v:.3f}" for c, v in dense.items())
        + "). Wall and peak RSS: the whole compress-model process (load, dense and compressed "
        "evaluation, after every stage for the recipe, export without the dense copy). "
        "Compressed-layer bytes as the report counts the stored form (values plus positions "
        "and scales), against the layers' dense fp32 bytes.\n\n" + markdown_table(header, rows)
    )


def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    return {"checkpoint": args.checkpoint, "eval_tokens": args.eval_tokens}


def record(args: argparse.Namespace, rows: list[dict]) -> dict[str, Any]:
    return {"settings": settings_of(args), "results": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="smollm2-135m")
    parser.add_argument("--eval-tokens", type=int, default=32768, help="per corpus, 0 = all")
    add_harness_args(parser, "rerun just these rows (names as in the table)")
    table = row_table(NAME, render, [j["name"] for j in JOBS], run_row, record)
    return run_table(table, parser.parse_args(argv), parser)


if __name__ == "__main__":
    sys.exit(main())
