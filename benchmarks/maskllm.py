"""The old name of ``python -m benchmarks.sweep maskllm``."""

from benchmarks.sweep import alias

alias(__name__, "maskllm")
