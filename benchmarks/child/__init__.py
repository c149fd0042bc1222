"""What a benchmark's jobs run in their own processes (``python -m benchmarks.child.NAME``).

These modules import torch and the library at the top; the benchmark drivers never import them
(they only name them in a job's command line), so a driver's ``--help`` and ``--render-only``
stay cheap. Each prints its result as JSON on stdout (``benchmarks.runner``'s ``STDOUT``) or
writes it where its command line says.
"""
