"""The old name of ``python -m benchmarks.sweep subnet``."""

from benchmarks.sweep import alias

alias(__name__, "subnet")
