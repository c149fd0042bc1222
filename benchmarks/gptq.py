"""The old name of ``python -m benchmarks.sweep gptq``."""

from benchmarks.sweep import alias

alias(__name__, "gptq")
