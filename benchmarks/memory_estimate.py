"""The memory estimate a job is admitted with against the peak RSS it reaches, for every method,
on SmolLM2-135M and on the seven tiny families.

    python -m benchmarks.memory_estimate                     # ~40 min on 2 cores
    python -m benchmarks.memory_estimate --only "smollm2-135m: wanda"
    python -m benchmarks.memory_estimate --render-only

Every row is a real ``compress-model`` job in its own process (``benchmarks.runner``: peak RSS
is the kernel's ``ru_maxrss`` of that process), with an output written (the save is part of
the job) and deleted after. The estimate is the one the job recorded in its
``compression.json`` (``memory_estimate``: what :func:`lmcompress.jobs.preflight.estimate_job`
admitted it with). The estimates aim to be within ``ESTIMATE_FACTOR`` (1.5, stated in
:mod:`lmcompress.compressor.model.budget`) of the peak, either way; a row outside it is marked.
The tiny checkpoints (``benchmarks.child.memory_estimate``) are the families of
``tests/conftest.py``: there the estimate is mostly the libraries' fixed share
(``RUNTIME_BYTES``), which ``tests/jobs/test_memory_estimate.py`` checks on every run.
Writes ``benchmarks/results/memory_estimate.{json,md}``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from functools import cache
from pathlib import Path
from typing import Any

from benchmarks.harness import add_harness_args, row_table, run_table
from benchmarks.render import markdown_table
from benchmarks.runner import CLI, PYTHON, STDOUT, Job, run_job

NAME = "memory_estimate"
SMOLLM2 = "smollm2-135m"
METHODS = {  # row name -> flags; on every model
    "magnitude": ("--method", "magnitude", "--sparsity", "2:4"),
    "wanda": ("--method", "wanda", "--sparsity", "2:4"),
    "sparsegpt": ("--method", "sparsegpt", "--sparsity", "2:4"),
    "maskllm": ("--method", "maskllm", "--steps", "4", "--prior", "wanda"),
    "subnet": ("--method", "subnet", "--steps", "4", "--prior", "wanda"),
    "svd": ("--method", "svd"),
    "asvd": ("--method", "asvd"),
    "svd-llm": ("--method", "svd-llm"),
    "fwsvd": ("--method", "fwsvd"),
    "gfwsvd": ("--method", "gfwsvd"),
    "gfwsvd nearest": ("--method", "gfwsvd", "--kronecker", "nearest"),
    "int8": ("--method", "int8"),
    "int8 static, 8-bit softmax": (
        *("--method", "int8", "--activations", "static"),
        *("--softmax-bits", "8", "--bias-correction", "layer"),
    ),
}
SMOLLM2_ONLY = {  # the parts the rows above leave small
    "wanda, 128 windows, no evaluation": ("--method", "wanda", "--nsamples", "128", "--eval"),
    "maskllm blockwise": ("--method", "maskllm", "--steps", "2", "--prior", "wanda", "--blockwise"),
    "sparsegpt --streaming": ("--method", "sparsegpt", "--sparsity", "2:4", "--streaming"),
}
SETTINGS = {  # shortened defaults: about a minute a job on SmolLM2
    SMOLLM2: (
        "--seq-len",
        "512",
        "--nsamples",
        "16",
        "--eval",
        "wiki-test",
        "--eval-tokens",
        "2048",
    ),
    "tiny": ("--seq-len", "64", "--nsamples", "8", "--eval", "wiki-test", "--eval-tokens", "512"),
}
FAMILIES = ("llama", "mistral", "qwen2", "gemma3_text", "gpt2", "opt", "gpt_neox")
# every method on the tiny Llama; on the other families one method of each kind (layer-wise,
# trained, gradient pass, calibrated int8): a tiny job is mostly its ~10 s of imports
KINDS = ("sparsegpt", "maskllm", "gfwsvd", "int8 static, 8-bit softmax")
JOBS = [
    *(f"{SMOLLM2}: {method}" for method in (*METHODS, *SMOLLM2_ONLY)),
    *(f"tiny llama: {method}" for method in METHODS),
    *(f"tiny {family}: {method}" for family in FAMILIES[1:] for method in KINDS),
]


@cache
def checkpoints(work: Path) -> dict[str, Any]:
    """The tiny checkpoints (written once per run), SmolLM2's cached directory, the factor."""
    command = (PYTHON, "-m", "benchmarks.child.memory_estimate", str(work / "tiny"))
    return run_job(Job("tiny checkpoints", command, STDOUT), work).result


def run_row(name: str, args: argparse.Namespace) -> dict[str, Any]:
    model, method = name.split(": ")
    flags = {**METHODS, **SMOLLM2_ONLY}[method]
    found = checkpoints(args.work)
    if model == SMOLLM2:
        checkpoint = found["smollm2"] if "--streaming" in flags else SMOLLM2
        settings = SETTINGS[SMOLLM2]
    else:
        checkpoint, settings = str(args.work / "tiny" / model.split()[1]), SETTINGS["tiny"]
    if "--streaming" in flags:  # a streamed job evaluates nothing (--eval is refused)
        settings = settings[: settings.index("--eval")]
    out = args.work / "outputs" / name.replace(": ", "-").replace(" ", "_")
    command = (*CLI, checkpoint, *settings, *flags, "-o", str(out), "-q")
    run = run_job(Job(name, command, out / "compression.json"), args.work)
    shutil.rmtree(out)
    estimate = run.result["results"]["memory_estimate"]
    ratio = estimate["total"] / (run.peak_rss_mb * 2**20)
    return {
        "name": name,
        "command": "compress-model " + " ".join((model.split()[-1], *settings, *flags)),
        "estimate_bytes": estimate["total"],
        "estimate_parts": estimate["parts"],
        "peak_rss_mb": run.peak_rss_mb,
        "estimate_over_peak": round(ratio, 3),
        "within_factor": 1 / found["factor"] <= ratio <= found["factor"],
        "wall_seconds": run.wall_seconds,
        "factor": found["factor"],
    }


def record(_args: argparse.Namespace, rows: list[dict]) -> dict[str, Any]:
    return {"settings": {"smollm2": SETTINGS[SMOLLM2], "tiny": SETTINGS["tiny"]}, "results": rows}


def _parts(parts: dict[str, int]) -> str:
    top = sorted(parts.items(), key=lambda item: -item[1])[:3]
    return ", ".join(f"{name} {n / 2**20:.0f}" for name, n in top)


def render(payload: dict[str, Any]) -> str:
    host, rows = payload["machine"], payload["results"]
    factor = rows[0]["factor"]
    mark = {True: "yes", False: "**no**"}
    big = [
        [
            r["name"].split(": ")[1],
            f"{r['estimate_bytes'] / 2**20:.0f}" + ("" if _counts_text(r) else " †"),
            f"{r['peak_rss_mb']:.0f}",
            f"{r['estimate_over_peak']:.2f}",
            mark[r["within_factor"]],
            _parts(r["estimate_parts"]),
            f"{r['wall_seconds']:.0f}",
        ]
        for r in rows
        if r["name"].startswith(SMOLLM2)
    ]
    tiny = {tuple(r["name"].split(": ")): r for r in rows if r["name"].startswith("tiny")}
    families = [f for f in FAMILIES if any(key[0] == f"tiny {f}" for key in tiny)]
    grid = []
    for method in METHODS:
        cells = [tiny.get((f"tiny {f}", method)) for f in families]
        shown = [
            ""
            if r is None
            else f"{r['estimate_over_peak']:.2f}"
            + ("" if r["within_factor"] else " ✗")
            + ("" if _counts_text(r) else " †")
            for r in cells
        ]
        grid.append([method, *shown])
    outside = [r["name"] for r in rows if not r["within_factor"]]
    return (
        "# Memory estimate against measured peak RSS\n\n"
        f"Host: {host.get('cpu_model')} ({', '.join(host.get('isa') or [])}), "
        f"{host.get('torch_threads')} torch threads, torch {host.get('torch')}, "
        f"transformers {host.get('transformers')}.\n\n"
        "Each row: a `compress-model` job in its own process, with an output written; the "
        "estimate it recorded in `compression.json` against its peak RSS (`ru_maxrss`). The "
        f"estimates aim to lie within a factor {factor} of the peak, either way "
        f"(estimate / peak in [{1 / factor:.2f}, {factor}]).\n\n"
        "## SmolLM2-135M\n\nFlags besides the method's: "
        f"`{' '.join(payload['settings']['smollm2'])}`. MiB throughout.\n\n"
        + markdown_table(
            ["job", "estimate", "peak RSS", "estimate / peak", "within", "largest parts", "wall s"],
            big,
        )
        + "\n## Tiny families (estimate / peak)\n\n"
        f"Hidden 32, two blocks, SmolLM2's vocabulary; `{' '.join(payload['settings']['tiny'])}`. "
        "The estimate is mostly the libraries' fixed share (400 MiB).\n\n"
        + markdown_table(["method", *families], grid)
        + f"\nOutside the factor: {', '.join(outside) if outside else 'none'}.\n"
        + (
            "\n†: run before the estimate counted tokenizing the corpora (the job read a "
            "corpus but its estimate has no part for it); rerun the row to update it.\n"
            if any(not _counts_text(r) for r in rows)
            else ""
        )
    )


def _counts_text(row: dict[str, Any]) -> bool:
    """Whether the row's estimate has the corpora's tokenizing in it (every row of a job that
    reads a corpus, since the estimate counts it)."""
    return any("token" in part for part in row["estimate_parts"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_harness_args(parser, "rerun just these rows (names as in JOBS, e.g. 'smollm2-135m: svd')")
    table = row_table(NAME, render, JOBS, run_row, record)
    return run_table(table, parser.parse_args(argv), parser)


if __name__ == "__main__":
    sys.exit(main())
