"""compressor.memory: glibc's mmap threshold and malloc_trim, where glibc is the allocator."""

import platform

import pytest

from lmcompress.compressor import memory


@pytest.mark.skipif(platform.system() != "Linux" or not platform.libc_ver()[0], reason="glibc")
def test_mallopt_and_trim_take_effect_under_glibc():
    assert memory.set_mmap_threshold(1 << 20) is True
    assert isinstance(memory.release_free_memory(), bool)


def test_without_glibc_both_calls_are_harmless_no_ops(monkeypatch):
    monkeypatch.setattr(memory, "_libc", False)
    assert memory.set_mmap_threshold(1 << 20) is False
    assert memory.release_free_memory() is False
