"""The old name of ``python -m benchmarks.sweep int8``."""

from benchmarks.sweep import alias

alias(__name__, "int8")
