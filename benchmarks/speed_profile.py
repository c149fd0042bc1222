"""Where a model's prefill and batch-1 decoding spend their time: a diagnostic beside
``benchmarks.speed``, which runs ``--buckets`` for the rows that miss a goal.

    python -m benchmarks.speed_profile smollm2-135m               # ops of the dense bf16 model
    python -m benchmarks.speed_profile OUT --steps 16             # an export, its runtime
    python -m benchmarks.speed_profile --buckets smollm2-135m OUT1 OUT2   # JSON, by module

Runs a 64-token prompt, then ``--steps`` greedy decode steps with a KV cache under
``torch.profiler``, and prints the ops by their own CPU time. ``--buckets`` times, for each
model, one prefill forward (``--prefill``) and the decode steps by the modules the time is
spent in (:func:`buckets`), in milliseconds per forward, and prints them as JSON. The compiled
CPU kernels are called through ctypes, which the profiler does not see as ops: their time is
the time of the module that calls them, which is why the buckets are modules and not ops.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function
from transformers import DynamicCache

from benchmarks.speed import BUCKETS
from lmcompress.compressor.formats.base import CompressedLinear
from lmcompress.compressor.io.layout import MANIFEST
from lmcompress.compressor.io.load import load_compressed
from lmcompress.compressor.model.loading import load_model
from lmcompress.evaluation.speed import parse_prefill


@torch.inference_mode()
def decode(model: torch.nn.Module, prompt: torch.Tensor, steps: int) -> None:
    cache = DynamicCache()
    token = model(input_ids=prompt, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
    for _ in range(steps):
        token = model(input_ids=token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)


def scope(name: str, module: nn.Module) -> str | None:
    """The bucket a module's own time goes to, or None (its time goes to its parent's)."""
    if name.endswith("lm_head"):
        return "lm_head"
    if isinstance(module, CompressedLinear):
        return "compressed linears"
    if isinstance(module, nn.Linear):
        return "dense linears"
    kind = type(module).__name__
    if kind.endswith("Attention"):
        return "attention"
    if kind.endswith("MLP"):
        return "mlp activation"
    if kind.endswith("RMSNorm"):
        return "norms"
    return None


def _bucket_range(name: str, module: nn.Module) -> str | None:
    bucket = scope(name, module)
    return None if bucket is None else f"bucket::{bucket}"


@contextlib.contextmanager
def module_ranges(model: nn.Module, label_of: Callable[[str, nn.Module], str | None]):
    """Within the block, each module that ``label_of(name, module)`` labels runs inside a
    ``record_function`` range of that label (forward hooks; removed on exit), so a profile
    can attribute time to modules (:func:`buckets`, ``benchmarks.int8_speed.profile``)."""
    stack, handles = [], []
    for name, module in model.named_modules():
        label = label_of(name, module)
        if not label:
            continue

        def enter(_module, _args, label=label):
            stack.append(record_function(label).__enter__())

        def leave(_module, _args, _out):
            stack.pop().__exit__(None, None, None)

        handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def buckets(model: nn.Module, run: Callable[[], Any]) -> dict[str, float]:
    """Milliseconds of ``run()`` by :data:`BUCKETS`: each module range's time less that of the
    module ranges inside it; ``other`` is the wall time none of them covers."""
    with module_ranges(model, _bucket_range), torch.inference_mode():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            run()
            wall = (time.perf_counter() - start) * 1e3
    times = dict.fromkeys(BUCKETS, 0.0)

    def inner_ranges(event) -> float:  # the time of the outermost bucket ranges below event
        total = 0.0
        for child in event.cpu_children:
            if child.name.startswith("bucket::"):
                total += child.cpu_time_total
            else:
                total += inner_ranges(child)
        return total

    for event in prof.events():
        if event.name.startswith("bucket::"):
            own = event.cpu_time_total - inner_ranges(event)
            times[event.name.removeprefix("bucket::")] += own / 1e3
    times["other"] = max(0.0, wall - sum(times.values()))
    return {key: round(value, 2) for key, value in times.items()}


def load(model: str, dtype: str) -> nn.Module:
    if (Path(model) / MANIFEST).is_file():
        return load_compressed(model, "packed")[0].eval()
    return load_model(model, dtype)[0].eval()


def profile_buckets(models: list[str], dtype: str, prefill: str, steps: int) -> dict[str, Any]:
    """For each model: prefill and decode milliseconds by bucket (decode: per step)."""
    batch, tokens = parse_prefill(prefill)
    ids = torch.randint(3, 1000, (batch, tokens), generator=torch.Generator().manual_seed(0))
    prompt = ids[:1, :64]
    record: dict[str, Any] = {"prefill": prefill, "decode_steps": steps, "models": {}}
    for name in models:
        model = load(name, dtype)
        with torch.inference_mode():
            model(ids, use_cache=False)  # warm-up
            decode(model, prompt, 4)
        prefill_ms = buckets(model, functools.partial(model, ids, use_cache=False))
        with torch.inference_mode():  # the prompt, outside the profile
            cache = DynamicCache()
            token = model(input_ids=prompt, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        decode_ms = buckets(model, functools.partial(steps_from, model, cache, token, steps))
        per_step = {key: round(value / steps, 2) for key, value in decode_ms.items()}
        record["models"][name] = {"prefill_ms": prefill_ms, "decode_ms_per_step": per_step}
        del model
    return record


def steps_from(model: nn.Module, cache: DynamicCache, token: torch.Tensor, steps: int) -> None:
    """``steps`` greedy decode steps after ``token``, with ``cache`` (inference mode)."""
    for _ in range(steps):
        token = model(input_ids=token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="+", help="a checkpoint, or a compress-model output")
    parser.add_argument("--dtype", default="bfloat16", help="of a checkpoint (default bfloat16)")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rows", type=int, default=12, help="ops shown")
    parser.add_argument("--buckets", action="store_true", help="JSON of time by module")
    parser.add_argument("--prefill", default="4x256", help="BATCHxTOKENS (--buckets)")
    args = parser.parse_args(argv)
    if args.buckets:
        print(json.dumps(profile_buckets(args.model, args.dtype, args.prefill, args.steps)))
        return 0
    if len(args.model) != 1:
        parser.error("one model at a time without --buckets")
    model = load(args.model[0], args.dtype)
    prompt = torch.randint(3, 1000, (1, 64), generator=torch.Generator().manual_seed(0))
    decode(model, prompt, 4)  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        decode(model, prompt, args.steps)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
