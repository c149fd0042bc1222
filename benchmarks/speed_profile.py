"""Where batch-1 decoding spends its time, by op: a diagnostic beside ``benchmarks.speed`` (it
writes no results file).

    python -m benchmarks.speed_profile smollm2-135m               # the dense model, bf16
    python -m benchmarks.speed_profile OUT --steps 16             # an export, its runtime

Runs a 64-token prompt, then ``--steps`` greedy decode steps with a KV cache under
``torch.profiler``, and prints the ops by their own CPU time.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import DynamicCache

from lmcompress.compressor.io.layout import MANIFEST
from lmcompress.compressor.io.load import load_compressed
from lmcompress.compressor.model.loading import load_model


@torch.inference_mode()
def decode(model: torch.nn.Module, prompt: torch.Tensor, steps: int) -> None:
    cache = DynamicCache()
    token = model(input_ids=prompt, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
    for _ in range(steps):
        token = model(input_ids=token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a checkpoint, or a compress-model output")
    parser.add_argument("--dtype", default="bfloat16", help="of a checkpoint (default bfloat16)")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rows", type=int, default=12, help="ops shown")
    args = parser.parse_args(argv)
    if (Path(args.model) / MANIFEST).is_file():
        model = load_compressed(args.model, "packed")[0]
    else:
        model = load_model(args.model, args.dtype)[0]
    prompt = torch.randint(3, 1000, (1, 64), generator=torch.Generator().manual_seed(0))
    decode(model.eval(), prompt, 4)  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        decode(model, prompt, args.steps)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
