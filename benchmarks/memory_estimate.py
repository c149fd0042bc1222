"""The old name of ``python -m benchmarks.sweep memory_estimate``."""

from benchmarks.sweep import alias

alias(__name__, "memory_estimate")
