"""Where a compress-model run's resident memory goes: run the CLI in this process, sample RSS
every 50 ms, and print the peak with the stack that was running at it, the RSS per 10 s, and —
whenever a model is evaluated — the bytes of live tensors next to the RSS (the gap is memory
the allocator keeps but nobody uses).

    python -m benchmarks.rss_profile COMPRESS-MODEL ARGS...
    MALLOC_MMAP_THRESHOLD_=1048576 python -m benchmarks.rss_profile ...   # glibc's knob, compare

A diagnostic, not a benchmark, and deliberately outside the benchmark harness: it prints to
stderr, writes no results file, and must run the CLI in its own process (the sampler thread
reads this process's RSS and the main thread's stack; the tensor census needs this process's
objects). The census is taken as every evaluate step starts, through the hook the library
exposes for it (``lmcompress.jobs.evaluate.register_evaluate_hook``), not by patching the
library. It produced the numbers in ``lmcompress/compressor/util/memory.py``'s docstring
(3-step MaskLLM, magnitude prior).
"""

from __future__ import annotations

import gc
import sys
import threading
import time
import traceback

import psutil
import torch

from lmcompress.cli.main import main as cli_main
from lmcompress.jobs.evaluate import register_evaluate_hook


def live_tensor_bytes() -> int:
    """Bytes of the distinct storages of every tensor the garbage collector can see."""
    gc.collect()
    seen, total = set(), 0
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor):
            try:
                storage = obj.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def main() -> int:
    process, main_thread = psutil.Process(), threading.get_ident()
    start, peak, timeline = time.time(), {"rss": 0, "stack": [], "at": 0.0}, []

    def sample() -> None:
        while True:
            rss = process.memory_info().rss
            if rss > peak["rss"]:
                frame = sys._current_frames().get(main_thread)
                stack = traceback.format_stack(frame)[-12:] if frame else []
                del frame  # holding it would keep that frame's locals (and tensors) alive
                peak.update(rss=rss, stack=stack, at=time.time() - start)
            timeline.append((time.time() - start, rss))
            time.sleep(0.05)

    def census(_model: torch.nn.Module) -> None:
        live, rss = live_tensor_bytes(), process.memory_info().rss
        message = f"at evaluation: live tensors {live / 2**20:.0f} MiB, RSS {rss / 2**20:.0f} MiB"
        print(message, file=sys.stderr)

    handle = register_evaluate_hook(census)
    threading.Thread(target=sample, daemon=True).start()
    try:
        return cli_main(sys.argv[1:])
    finally:
        handle.remove()
        print(f"peak RSS {peak['rss'] / 2**20:.0f} MiB at {peak['at']:.1f} s, in:", file=sys.stderr)
        print("".join(peak["stack"]), file=sys.stderr)
        buckets: dict[int, int] = {}
        for t, rss in timeline:
            buckets[int(t // 10)] = max(buckets.get(int(t // 10), 0), rss)
        per_10s = " ".join(f"{b * 10}s:{r / 2**20:.0f}" for b, r in sorted(buckets.items()))
        print(f"max RSS per 10 s (MiB): {per_10s}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
