"""How fast MaskLLM's end-to-end driver learns on SmolLM2-135M: seconds per training step and
tokens/s for each noise source, with the fused soft-mask kernel and without it (the torch path),
batch 1 and 4, fp32 and bf16 autocast.

    OMP_NUM_THREADS=1 python -m benchmarks.learned_speed [--rounds 2] [--steps 3]
    python -m benchmarks.learned_speed --render-only

Every configuration is a ``compress()`` of a fresh copy of the model with ``--steps`` steps
(distillation on, the magnitude prior, no held-out windows) on wiki-calib windows; a row's step
time is the median over rounds of the steps after the first (which pays for first-touch
allocations). Rows run interleaved, kernel off and on back to back in every round, so a change
in the machine's load reaches both. The ratio column is the kernel-off step time over the row's,
for the same noise and batch. Noise "counter" has no torch row: its torch path is the kernel's
reference (int64 hashing, ~100 s a step), not a way to train.
Results: ``results/learned_speed.{json,md}``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from typing import Any

import torch

from benchmarks.harness import Table, add_harness_args, run_table
from benchmarks.render import markdown_table
from lmcompress import MaskLLMConfig, compress
from lmcompress.compressor.model.loading import load_model
from lmcompress.jobs.evaluate import JobText
from lmcompress.jobs.options import RunOptions
from lmcompress.methods.maskllm.parametrization import LearnableNMMask

NAME = "learned_speed"
SEQ_LEN = 512
# name -> (noise, batch size, bf16 autocast, fused kernel)
CONFIGS: dict[str, tuple[str, int, bool, bool]] = {
    "exact, torch": ("exact", 1, False, False),
    "pool, torch": ("pool", 1, False, False),
    "pool, kernel": ("pool", 1, False, True),
    "counter, kernel": ("counter", 1, False, True),
    "pool, torch, batch 4": ("pool", 4, False, False),
    "pool, kernel, batch 4": ("pool", 4, False, True),
    "pool, kernel, bf16": ("pool", 1, True, True),
}


def step_seconds(model, data: torch.Tensor, name: str, steps: int) -> list[float]:
    noise, batch, bf16, kernel = CONFIGS[name]
    config = MaskLLMConfig(
        sparsity="2:4", steps=steps, batch_size=batch, lr=2e-4, prior="magnitude",
        eval_windows=0, distill=True, noise=noise, bf16=bf16,
    )  # fmt: skip
    LearnableNMMask.use_kernel = kernel
    try:
        _, stats = compress(copy.deepcopy(model), config, data, return_stats=True)
    finally:
        LearnableNMMask.use_kernel = True
    return [h["seconds"] for h in stats.meta["history"]][1:]


def measure(args: argparse.Namespace, names: list[str], previous: dict) -> Any:  # noqa: ARG001
    model, tokenizer = load_model("smollm2-135m")
    options = RunOptions(
        checkpoint="smollm2-135m", calib="wiki-calib", nsamples=16, seq_len=SEQ_LEN, seed=0
    )
    data = JobText(tokenizer, options, evaluates=False).calibration()
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(args.rounds):
        for name in names:
            start = time.perf_counter()
            times[name] += step_seconds(model, data, name, args.steps)
            print(f"round {round_ + 1} {name}: {time.perf_counter() - start:.0f} s", flush=True)
    rows = []
    for name in names:
        noise, batch, bf16, kernel = CONFIGS[name]
        median = statistics.median(times[name])
        rows.append({"name": name, "noise": noise, "batch_size": batch, "bf16": bf16,
                     "kernel": kernel, "step_seconds": times[name], "median_seconds": median,
                     "tokens_per_second": batch * SEQ_LEN / median})  # fmt: skip
    yield {"settings": {"steps": args.steps, "rounds": args.rounds, "seq_len": SEQ_LEN,
                        "threads": torch.get_num_threads()}, "results": rows}  # fmt: skip


def render(payload: dict[str, Any]) -> str:
    s, host = payload["settings"], payload.get("machine", {})
    rows = payload["results"]
    torch_path = {(r["noise"], r["batch_size"]): r for r in rows if not r["kernel"]}
    paper = torch_path.get(("exact", 1))  # the paper's noise, the torch path, one window
    lines = [
        "# MaskLLM end-to-end step speed on SmolLM2-135M (`python -m benchmarks.learned_speed`)\n",
        f"One step: the masks sampled for all 159M logits, forward and backward of "
        f"`batch` windows of {s['seq_len']} tokens, the dense teacher's forward (distillation), "
        f"AdamW on the logits. Median of the steps after the first, {s['rounds']} rounds of "
        f"{s['steps']} steps, rows interleaved; {s['threads']} torch thread(s). Machine: "
        f"{host.get('cpu_model', '?')} ({', '.join(host.get('isa', []) or ['-'])}).\n",
    ]
    table = []
    for r in rows:
        base = torch_path.get((r["noise"], r["batch_size"]))
        ratio = base["median_seconds"] / r["median_seconds"] if base and not r["bf16"] else None
        table.append([
            r["name"], r["noise"], r["batch_size"], "bf16" if r["bf16"] else "fp32",
            "fused" if r["kernel"] else "torch", f"{r['median_seconds']:.2f}",
            f"{r['tokens_per_second']:.1f}", "-" if ratio is None else f"{ratio:.2f}x",
            f"{r['tokens_per_second'] / paper['tokens_per_second']:.2f}x" if paper else "-",
        ])  # fmt: skip
    header = ["config", "noise", "batch", "dtype", "mask", "s / step", "tokens/s",
              "step speed-up over the torch path", "tokens/s ÷ exact, torch"]  # fmt: skip
    lines.append(markdown_table(header, table))
    if payload.get("note"):
        lines += ["", payload["note"], ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_harness_args(parser, "run only these configurations", work=False)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="steps per run (the first dropped)")
    args = parser.parse_args(argv)
    return run_table(Table(NAME, render, measure, list(CONFIGS)), args, parser)


if __name__ == "__main__":
    sys.exit(main())
