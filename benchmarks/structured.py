"""``python -m benchmarks.structured``: ``python -m benchmarks.sweep structured``."""

from benchmarks.sweep import alias

alias(__name__, "structured")
