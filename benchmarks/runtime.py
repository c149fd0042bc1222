"""The old name of ``python -m benchmarks.sweep runtime``."""

from benchmarks.sweep import alias

alias(__name__, "runtime")
