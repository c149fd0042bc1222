"""The old name of ``python -m benchmarks.sweep lowrank``."""

from benchmarks.sweep import alias

alias(__name__, "lowrank")
