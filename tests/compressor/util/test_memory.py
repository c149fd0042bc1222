"""compressor.memory: glibc's mmap threshold and malloc_trim do what memory.py promises, measured
through glibc's own accounting (mallinfo2) and the process's resident set (/proc/self/statm)."""

from __future__ import annotations

import ctypes
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from lmcompress.compressor.util import memory

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
MiB = 1 << 20


class _Mallinfo2(ctypes.Structure):
    _fields_ = [  # glibc >= 2.33, malloc.h
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost",
        )
    ]  # fmt: skip


def _libc():
    libc = memory._glibc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        pytest.skip("needs glibc >= 2.33 (mallinfo2)")
    libc.mallinfo2.restype = _Mallinfo2
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    return libc


def _mmapped_bytes(libc) -> int:
    return libc.mallinfo2().hblkhd  # bytes in chunks served by their own mmap


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# In a fresh process: a long-running one may hold free heap chunks big enough to serve the
# allocation below without asking the system, whatever the threshold.
_THRESHOLD_PROBE = """
import ctypes, json
from lmcompress.compressor.util import memory
from compressor.util.test_memory import _libc, _mmapped_bytes, MiB
libc = _libc()
grew = {}
for threshold in (1 * MiB, 4 * MiB):  # the mmapped case first: nothing in the heap to reuse
    ok = memory.set_mmap_threshold(threshold)
    before = _mmapped_bytes(libc)
    block = libc.malloc(2 * MiB)  # between the two thresholds
    grew[threshold] = [ok, bool(block), _mmapped_bytes(libc) - before]
    libc.free(block)
print(json.dumps(grew))
"""


@pytest.mark.skipif(not GLIBC, reason="glibc")
def test_mmap_threshold_decides_which_allocations_get_their_own_mapping():
    _libc()  # skips without mallinfo2
    tests_dir = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests_dir), *sys.path])}
    done = subprocess.run(
        [sys.executable, "-c", _THRESHOLD_PROBE], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr
    grew = {int(k): v for k, v in json.loads(done.stdout).items()}
    assert grew[MiB][:2] == [True, True] and grew[MiB][2] >= 2 * MiB  # its own mapping
    assert grew[4 * MiB][:2] == [True, True] and grew[4 * MiB][2] == 0  # from the heap


@pytest.mark.skipif(not GLIBC, reason="glibc")
def test_release_free_memory_returns_freed_heap_pages_to_the_system():
    libc = _libc()
    memory.set_mmap_threshold(MiB)  # 64 KiB blocks below it: served from the heap
    blocks = [libc.malloc(64 * 1024) for _ in range(1024)]  # 64 MiB
    assert all(blocks)
    for block in blocks:
        ctypes.memset(block, 1, 64 * 1024)  # make the pages resident
    for block in blocks[:-1]:  # the last one pins the heap top: free() alone cannot trim
        libc.free(block)
    resident = _rss()
    assert memory.release_free_memory() is True
    released = resident - _rss()
    libc.free(blocks[-1])
    assert released > 32 * MiB, released


def test_without_glibc_both_calls_are_harmless_no_ops(monkeypatch):
    monkeypatch.setattr(memory, "_libc", False)
    assert memory.set_mmap_threshold(1 << 20) is False
    assert memory.release_free_memory() is False
