"""Memory per process of MaskLLM end-to-end training on SmolLM2-135M: one process, two processes
data parallel, two processes FSDP (``--fsdp``), all under ``accelerate launch``.

    python -m benchmarks.maskllm_fsdp                 # the three runs -> results/maskllm_fsdp.*
    python -m benchmarks.maskllm_fsdp --only "2 processes, FSDP"   # rerun one, merge it
    python -m benchmarks.maskllm_fsdp --render-only   # rewrite the md from the json

Each run trains the 2:4 mask logits of every decoder linear for ``--steps`` steps of
``--batch-size`` windows of 512 tokens (split over the processes) from the magnitude prior (the
prior is not what is measured) and records, per process: its peak RSS (``getrusage``), the
number of mask logits it holds (its shard under FSDP: the method reports it in
``report.extra["trainable_elements_per_process"]``), the seconds per step, and the final
logits' checksum (the three runs see the same data and noise, so they should learn the same
logits up to float rounding). On CPU, ``accelerate launch --multi_gpu --num_processes 2``
starts the two processes (see ``tests/methods/test_maskllm_distributed.py``); each gets one
OpenMP thread from torchrun, so the one-process run is launched the same way for comparison.
Each launch is one job of ``benchmarks.runner`` (its wall time); every process of it
(``benchmarks.child.maskllm_fsdp``) writes its own record, which is why the per-process numbers
come from the processes themselves.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import add_harness_args, row_table, run_table
from benchmarks.render import markdown_table
from benchmarks.runner import PYTHON, Job, run_job

NAME = "maskllm_fsdp"
RUNS = [  # name, processes, extra MaskLLM options
    ("1 process", 1, {}),
    ("2 processes, data parallel", 2, {}),
    ("2 processes, FSDP", 2, {"fsdp": True}),
]


def launch_job(name: str, processes: int, options: dict, settings: dict, out: Path) -> Job:
    """``accelerate launch`` of ``benchmarks.child.maskllm_fsdp`` on ``processes`` CPU
    processes."""
    job = {**{k: settings[k] for k in ("checkpoint", "calib", "nsamples", "seq_len")}, "seed": 0}
    job.update(steps=settings["steps"], batch_size=settings["batch_size"], options=options)
    accelerate = Path(PYTHON).parent / "accelerate"
    mode = ["--multi_gpu"] if processes > 1 else ["--cpu"]
    command = (
        accelerate, "launch", *mode, "--num_processes", str(processes),
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "-m", "benchmarks.child.maskllm_fsdp", json.dumps(job), str(out),
    )  # fmt: skip
    return Job(name, command, env={"OMP_NUM_THREADS": "1"})


def launch(name: str, args: argparse.Namespace) -> dict:
    """One row: the launch's wall time, and the record every process wrote."""
    processes, options = next((p, o) for n, p, o in RUNS if n == name)
    settings, work = settings_of(args), args.work
    with tempfile.TemporaryDirectory() as tmp:
        run = run_job(launch_job(name, processes, options, settings, Path(tmp)), work)
        ranks = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank*.json"))]
    return {
        "name": name,
        "processes": processes,
        "options": options,
        "wall_seconds": run.wall_seconds,
        "ranks": ranks,
    }


def render(payload: dict[str, Any]) -> str:
    rows, settings = payload["runs"], payload["settings"]
    header = [
        "run",
        "peak RSS MiB per process",
        "mask logits held per process",
        "train s",
        "loss per step (mean over processes)",
        "sum of abs(logits) (same training?)",
    ]
    body = []
    for row in rows:
        ranks = row["ranks"]
        losses = zip(*(r["losses"] for r in ranks), strict=True)  # per step, over processes
        body.append([
            row["name"],
            " / ".join(f"{r['peak_rss_mb']:.0f}" for r in ranks),
            " / ".join(f"{r['logits_held']:,}" for r in ranks),
            f"{max(r['seconds'] for r in ranks):.0f}",
            " ".join(f"{sum(v) / len(v):.3f}" for v in losses),
            f"{ranks[0]['logits_abs_sum']:.6g}",
        ])  # fmt: skip
    intro = (
        f"MaskLLM end to end on {settings['checkpoint']}, 2:4 on every decoder linear, magnitude "
        f"prior, {settings['steps']} steps of {settings['batch_size']} windows × "
        f"{settings['seq_len']} tokens of {settings['calib']} (split over the processes), one "
        "OpenMP thread per process, all runs launched by `accelerate launch`. Peak RSS: each "
        "process's own (getrusage), including the model it loads and the prior.\n\n"
    )
    return intro + markdown_table(header, body)


def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    keys = ("checkpoint", "calib", "nsamples", "seq_len", "steps", "batch_size")
    return {k: getattr(args, k) for k in keys}


def record(args: argparse.Namespace, rows: list[dict]) -> dict[str, Any]:
    finished = time.strftime("%Y-%m-%d %H:%M:%S")
    return {"settings": settings_of(args), "runs": rows, "finished": finished}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="smollm2-135m")
    parser.add_argument("--calib", default="wiki-calib")
    parser.add_argument("--nsamples", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=2, help="windows per step, in all")
    names = [name for name, _, _ in RUNS]
    add_harness_args(parser, f"rerun just these runs, of: {'; '.join(names)}")
    table = row_table(NAME, render, names, launch, record, field="runs")
    return run_table(table, parser.parse_args(argv), parser)


if __name__ == "__main__":
    sys.exit(main())
