"""What a measurement was made on, as every results JSON and speed table records it
(``machine``): CPU model, ISA flags, threads, versions.

    python -m lmcompress.evaluation.host      # prints the record as JSON

The benchmarks run it in a process of their own (``benchmarks.runner.machine``) with the
environment the jobs get, so that ``torch_threads`` is what a job's torch takes
(``OMP_NUM_THREADS`` or the cores), not whatever the driver set. The ISA flags are those of
``/proc/cpuinfo`` that the int8 and bf16 paths can use (AMX, AVX-512 VNNI and BF16, AVX2):
absent from the list means the CPU lacks it; ``None`` means the file could not be read.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

import torch
import transformers

ISA_FLAGS = ("amx_int8", "amx_bf16", "avx512_vnni", "avx512_bf16", "avx2")


def cpu_info(cpuinfo: str) -> dict[str, Any]:
    """``{"cpu_model", "isa"}`` from the text of ``/proc/cpuinfo`` (its first processor)."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    return {
        "cpu_model": fields.get("model name"),
        "isa": [flag for flag in ISA_FLAGS if flag in flags],
    }


def machine() -> dict[str, Any]:
    try:
        cpu = cpu_info(Path("/proc/cpuinfo").read_text())
    except OSError:
        cpu = {"cpu_model": platform.processor() or None, "isa": None}
    return {
        "cpu_count": os.cpu_count(),
        **cpu,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


if __name__ == "__main__":
    print(json.dumps(machine()))
