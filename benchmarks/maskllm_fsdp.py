"""Memory per process of MaskLLM end-to-end training on SmolLM2-135M: one process, two processes
data parallel, two processes FSDP (``--fsdp``), all under ``accelerate launch``.

    python benchmarks/maskllm_fsdp.py            # the three runs -> results/maskllm_fsdp.{json,md}
    python benchmarks/maskllm_fsdp.py --render-only   # rewrite the md from the json

Each run trains the 2:4 mask logits of every decoder linear for ``--steps`` steps of
``--batch-size`` windows of 512 tokens (split over the processes) from the magnitude prior (the
prior is not what is measured) and records, per process: its peak RSS (``getrusage``), the
number of mask logits it holds (its shard under FSDP), the seconds per step, and the final
logits' checksum (the three runs see the same data and noise, so they should learn the same
logits up to float rounding). On CPU, ``accelerate launch --multi_gpu --num_processes 2``
starts the two processes (see ``tests/methods/test_maskllm_distributed.py``); each gets one
OpenMP thread from torchrun, so the one-process run is launched the same way for comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import ROOT, machine, markdown_table, peak_rss_mb, write_results  # noqa: E402

RUNS = [  # name, processes, extra MaskLLM options
    ("1 process", 1, {}),
    ("2 processes, data parallel", 2, {}),
    ("2 processes, FSDP", 2, {"fsdp": True}),
]


def child(job: dict, out: Path) -> None:
    """One process of a run (started by accelerate launch): train, then write its record."""
    import torch

    from lmcompress import MaskLLMConfig, compress
    from lmcompress.compressor.models import load_model
    from lmcompress.evaluation.corpora import calibration_windows, tokenize
    from lmcompress.methods.maskllm import method as maskllm_method

    held = {}
    shard = maskllm_method.distributed.shard_modules

    def recording_shard(modules, device):  # note the share of the logits this process keeps
        modules = list(modules)
        count = shard(modules, device)
        held["local"] = sum(m.logits.to_local().numel() for m in modules)
        return count

    maskllm_method.distributed.shard_modules = recording_shard
    model, tokenizer = load_model(job["checkpoint"])
    ids = tokenize(tokenizer, job["calib"])
    data = calibration_windows(ids, job["nsamples"], job["seq_len"], job["seed"])
    config = MaskLLMConfig(
        sparsity="2:4",
        steps=job["steps"],
        batch_size=job["batch_size"],  # in all: each process takes its share of every batch
        lr=2e-4,
        prior="magnitude",
        eval_windows=0,
        **job["options"],
    )
    start = time.perf_counter()
    report, stats = compress(model, config, data, return_stats=True)
    seconds = time.perf_counter() - start
    total = sum(t.numel() for t in stats.tensors.values())
    checksum = sum(float(t.double().abs().sum()) for t in stats.tensors.values())
    history = report.extra["loss_curve"]
    record = {
        "rank": int(os.environ.get("RANK", "0")),
        "peak_rss_mb": peak_rss_mb(),
        "logits_total": total,
        "logits_held": held.get("local", total),
        "seconds": round(seconds, 1),
        "losses": [round(h["loss"], 4) for h in history],
        "logits_abs_sum": checksum,
        "threads": torch.get_num_threads(),
    }
    (out / f"rank{record['rank']}.json").write_text(json.dumps(record))


def launch(name: str, processes: int, options: dict, args: argparse.Namespace) -> dict:
    job = {
        "checkpoint": args.checkpoint,
        "calib": args.calib,
        "nsamples": args.nsamples,
        "seq_len": args.seq_len,
        "seed": 0,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "options": options,
    }
    with tempfile.TemporaryDirectory() as tmp:
        accelerate = Path(sys.executable).parent / "accelerate"
        mode = ["--multi_gpu"] if processes > 1 else ["--cpu"]
        command = [
            str(accelerate), "launch", *mode, "--num_processes", str(processes),
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            __file__, "--child", json.dumps(job), tmp,
        ]  # fmt: skip
        env = {**os.environ, "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1"}
        start = time.perf_counter()
        proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            raise RuntimeError(f"{name} failed:\n{proc.stderr[-3000:]}")
        ranks = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank*.json"))]
    return {
        "name": name,
        "processes": processes,
        "options": options,
        "wall_seconds": round(wall, 1),
        "ranks": ranks,
    }


def table(rows: list[dict], settings: dict) -> str:
    header = [
        "run",
        "peak RSS MB per process",
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=2, metavar=("JOB", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", default="smollm2-135m")
    parser.add_argument("--calib", default="wiki-calib")
    parser.add_argument("--nsamples", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=2, help="windows per step, in all")
    parser.add_argument("--results-dir", default=str(HERE / "results"))
    parser.add_argument("--render-only", action="store_true", help="rewrite the md from the json")
    args = parser.parse_args()
    stem = Path(args.results_dir) / "maskllm_fsdp"
    if args.render_only:
        payload = json.loads(stem.with_suffix(".json").read_text())
        stem.with_suffix(".md").write_text(table(payload["runs"], payload["settings"]))
        return 0
    if args.child:
        child(json.loads(args.child[0]), Path(args.child[1]))
        return 0
    settings = {k: v for k, v in vars(args).items() if k not in ("child", "results_dir")}
    rows = []
    for name, processes, options in RUNS:
        print(f"{name} ...", flush=True)
        rows.append(launch(name, processes, options, args))
        print(json.dumps(rows[-1]), flush=True)
    payload = {"settings": settings, "machine": machine(), "runs": rows,
               "finished": time.strftime("%Y-%m-%d %H:%M:%S")}  # fmt: skip
    write_results(stem, payload, table(rows, settings))
    print(table(rows, settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
