"""The old name of ``python -m benchmarks.sweep magnitude``."""

from benchmarks.sweep import alias

alias(__name__, "magnitude")
