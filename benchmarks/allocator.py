"""Peak live bytes of torch's CPU allocator while a function runs: how the tests and the
benchmarks that bound a computation's memory measure it."""

from __future__ import annotations

from collections.abc import Callable

from torch.profiler import ProfilerActivity, profile


def peak_allocated_bytes(fn: Callable[[], object]) -> int:
    """Peak of the CPU allocator's live bytes while ``fn`` runs, above where it started.

    The profiler reports every allocation and free of torch's CPU allocator (not just the
    largest tensor), so the running sum is the live-bytes curve; the same calls always give the
    same curve.
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak
