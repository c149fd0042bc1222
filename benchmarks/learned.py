"""The old name of ``python -m benchmarks.sweep learned``."""

from benchmarks.sweep import alias

alias(__name__, "learned")
