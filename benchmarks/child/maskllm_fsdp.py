"""One process of a ``benchmarks.maskllm_fsdp`` run, started by ``accelerate launch``: train the
2:4 mask logits, then write this process's record to ``OUT/rankN.json``.

    accelerate launch ... -m benchmarks.child.maskllm_fsdp JOB_JSON OUT

The calibration windows are those a compression job reads (:class:`JobText`).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

from lmcompress import MaskLLMConfig, compress
from lmcompress.compressor.model.loading import load_model
from lmcompress.jobs.evaluate import JobText
from lmcompress.jobs.options import RunOptions


def run(job: dict[str, Any], out: Path) -> None:
    model, tokenizer = load_model(job["checkpoint"])
    options = RunOptions(
        checkpoint=job["checkpoint"],
        calib=job["calib"],
        nsamples=job["nsamples"],
        seq_len=job["seq_len"],
        seed=job["seed"],
    )
    data = JobText(tokenizer, options, evaluates=False).calibration()
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
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "logits_total": total,
        "logits_held": report.extra["trainable_elements_per_process"],
        "seconds": round(seconds, 1),
        "losses": [round(h["loss"], 4) for h in history],
        "logits_abs_sum": checksum,
        "threads": torch.get_num_threads(),
    }
    (out / f"rank{record['rank']}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    run(json.loads(sys.argv[1]), Path(sys.argv[2]))
