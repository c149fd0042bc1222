"""The old name of ``python -m benchmarks.sweep pruning``."""

from benchmarks.sweep import alias

alias(__name__, "pruning")
