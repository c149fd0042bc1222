"""Keep the process's resident memory close to its live tensors on CPU (glibc malloc).

A training step allocates and frees thousands of tensors of 0.1-10 MB (soft masks, gradients,
activations). glibc serves allocations below its mmap threshold from the heap, and that
threshold rises by itself (up to 32 MB) each time a larger mmapped block is freed, so after the
first steps nearly every tensor comes from the heap; freed heap memory is kept for reuse and,
fragmented, is rarely returned. Measured with ``benchmarks/rss_profile.py`` on SmolLM2-135M,
MaskLLM end to end (3 steps, magnitude prior): peak RSS 5723 MiB against ~4.6 GB of live
tensors, and 5449 MiB still resident at the final evaluation with 1126 MiB of live tensors. With
a fixed 1 MiB threshold: peak 4788 MiB and 2191 MiB at the evaluation, for ~20 % longer steps
(fresh pages are zeroed by the kernel). The paper-recipe benchmark (100 steps, SparseGPT prior):
peak 6261 -> 4856 MiB, 1613 -> 1986 s.

Both calls are no-ops where glibc is absent (macOS, musl): the result then says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import resource
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # mallopt parameter numbers, from glibc's malloc.h
_libc = None


def _glibc():
    global _libc
    if _libc is None:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _libc = libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else False
        except OSError:
            _libc = False
    return _libc or None


def set_mmap_threshold(nbytes: int) -> bool:
    """Serve every allocation of at least ``nbytes`` with its own mmap, returned to the system
    when freed (this also stops glibc from raising the threshold). True if it took effect."""
    libc = _glibc()
    ok = bool(libc and libc.mallopt(M_MMAP_THRESHOLD, ctypes.c_int(nbytes)))
    logger.debug("mmap threshold %d bytes: %s", nbytes, "set" if ok else "not available")
    return ok


def release_free_memory() -> bool:
    """Give the heap's free pages back to the system (``malloc_trim(0)``). True if any was."""
    libc = _glibc()
    return bool(libc and libc.malloc_trim(0))


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far, in MiB.

    On Linux this is ``VmHWM`` of the process's own address space: ``getrusage``'s
    ``ru_maxrss`` survives ``execve``, so a process started by a large one (a test runner, a
    benchmark driver) would report its parent's peak instead of its own.
    """
    peak = _status_mib("VmHWM")
    if peak is not None:
        return peak
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / (2**20 if sys.platform == "darwin" else 2**10), 1)


def current_rss_mib() -> float:
    """Resident set size of this process now, in MiB (0 where ``/proc`` cannot tell)."""
    now = _status_mib("VmRSS")
    return 0.0 if now is None else now


def _status_mib(field: str) -> float | None:
    """A memory line of ``/proc/self/status`` (``VmHWM``, ``VmRSS``) in MiB; None off Linux."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return round(int(line.split()[1]) / 2**10, 1)  # kB
    except OSError:
        pass
    return None
