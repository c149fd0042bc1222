"""The old name of ``python -m benchmarks.sweep recipes``."""

from benchmarks.sweep import alias

alias(__name__, "recipes")
