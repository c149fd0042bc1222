"""Offline GPU resource report of the Triton kernels: registers, spills and shared memory of
every kernel and configuration, compiled for sm_80 and sm_90 on a machine with no GPU.

    python -m benchmarks.ptx_report                 # -> benchmarks/results/ptx_report.{json,md}

What it compiles and how: :mod:`lmcompress.kernels.ptx_report` (Triton's compiler and the
ptxas that the Triton wheel ships, in a child process without ``TRITON_INTERPRET``). No GPU
runs: these are the compiler's figures, not timings. ``tests/kernels/test_ptx_report.py``
checks the same on every CI run where ptxas is present: no spills, at most 255 registers, the
architecture's shared memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Iterator
from typing import Any

from benchmarks.harness import Table, add_harness_args, run_table
from lmcompress.kernels import ptx_report

NAME = "ptx_report"


def measure(_args: argparse.Namespace, _names: list[str], _previous: dict) -> Iterator[dict]:
    import triton

    entries = ptx_report.report_in_child()
    yield {
        "triton": triton.__version__,
        "archs": list(ptx_report.ARCHS),
        "shared_limit": {str(k): v for k, v in ptx_report.SHARED_LIMIT.items()},
        "entries": [dataclasses.asdict(e) for e in entries],
    }


def render(record: dict[str, Any]) -> str:
    host = record["machine"]
    entries = [ptx_report.Entry(**row) for row in record["entries"]]
    bad = [e for e in entries if e.problems]
    archs = record["archs"]
    lines = [
        f"Compiled on {host.get('cpu_model')} (no GPU) with Triton {record['triton']} and the "
        f"ptxas it ships, for sm_{' and sm_'.join(str(a) for a in archs)}: "
        f"{len(entries)} kernel builds, {len(bad)} with a spill, over 255 registers or over "
        "the shared memory limit (sm_80 163 KiB, sm_90 227 KiB). Registers per thread; spill "
        "stores / loads in bytes; shared memory in KiB (Triton's allocation). The compiler's "
        "figures, not timings. Each architecture compiles its own autotuning list "
        "(`nm_linear_triton._configs`).",
        "",
        "| arch | kernel | configuration | registers | spill stores / loads | shared KiB |",
        "|---|---|---|---|---|---|",
    ]
    for e in entries:
        lines.append(
            f"| sm_{e.arch} | {e.kernel} | {e.name} | {e.registers} | "
            f"{e.spill_stores} / {e.spill_loads} | {e.shared_bytes / 1024:.1f} |"
        )
    if bad:
        lines += ["", "Problems:", ""]
        lines += [f"- {e.kernel} {e.name} sm_{e.arch}: {', '.join(e.problems)}" for e in bad]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_harness_args(parser, work=False)
    args = parser.parse_args(argv)
    return run_table(Table(NAME, render, measure), args, parser)


if __name__ == "__main__":
    sys.exit(main())
