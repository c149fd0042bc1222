"""What verifying an export at load costs, on SmolLM2-135M exports of every compressed format.

    python -m benchmarks.load_checks                      # every row
    python -m benchmarks.load_checks --only int8 --repeats 9
    python -m benchmarks.load_checks --render-only

Every loader checks what it rebuilds before a forward pass (packed positions below M and
ascending within each group, every float value, factor, bias and scale finite; see
:mod:`lmcompress.compressor.formats`). Each row makes one export with ``compress-model``
(``--no-dense-copy``: the compact form ``from_pretrained`` also reads), then, in this process,
loads it ``--repeats`` times with the checks and as many times with them replaced by no-ops,
interleaved (the order alternates), through ``load_compressed(runtime="packed")`` and through
``transformers``' ``from_pretrained`` after ``import lmcompress``. The table gives the median
load times and their ratio. Writes ``benchmarks/results/load_checks.{json,md}``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import transformers

import lmcompress
from benchmarks.harness import add_harness_args, row_table, run_table
from benchmarks.render import markdown_table
from benchmarks.runner import CLI
from lmcompress.compressor.formats import base, quant, schema
from lmcompress.compressor.io import load
from lmcompress.kernels import ops

NAME = "load_checks"
QUICK = ("--eval", "--skip-dense", "--no-dense-copy", "-q")
ROWS: dict[str, tuple[str, ...]] = {  # name -> compress-model flags of the export
    "2:4 (nm_packed)": ("--method", "magnitude", "--sparsity", "2:4"),
    "svd 0.5 (low_rank)": ("--method", "svd", "--ratio", "0.5"),
    "int8": ("--method", "int8", "--nsamples", "16", "--seq-len", "256"),
    "2:4 + int8 (nm_packed_int8)": ("--config", "{recipe}"),
}
RECIPE = (
    "nsamples: 16\nseq_len: 256\nstages:\n"
    "  - {method: magnitude, sparsity: '2:4'}\n  - {method: int8}\n"
)
LOADERS: dict[str, Callable[[Path], Any]] = {
    "load_compressed": lambda out: lmcompress.load_compressed(out, runtime="packed"),
    "from_pretrained": lambda out: transformers.AutoModelForCausalLM.from_pretrained(out),
}


def _nothing(*_args: Any, **_kwargs: Any) -> None:
    return None


@contextlib.contextmanager
def checks_off() -> Iterator[None]:
    """The load-time checks replaced by no-ops (what loading cost before they existed)."""
    saved = [
        (schema, "check_finite"),  # every format's floating tensors (its Schema)
        (load, "check_finite"),  # load_compressed's dense part
        (base, "check_finite"),  # the quantizer's dense part (imported when it runs)
        (ops, "bad_positions"),
        (quant, "check_scale"),
    ]
    originals = [getattr(module, name) for module, name in saved]
    for module, name in saved:
        setattr(module, name, _nothing)
    try:
        yield
    finally:
        for (module, name), original in zip(saved, originals, strict=True):
            setattr(module, name, original)


def _timed(load: Callable[[Path], Any], out: Path) -> float:
    gc.collect()
    start = time.perf_counter()
    loaded = load(out)
    seconds = time.perf_counter() - start
    del loaded
    return seconds


def run_row(name: str, args: argparse.Namespace) -> dict[str, Any]:
    work = args.work / name.split()[0].replace(":", "-").replace("+", "p")
    out = work / "out"
    if not out.is_dir():
        work.mkdir(parents=True, exist_ok=True)
        (work / "recipe.yaml").write_text(RECIPE)
        flags = tuple(f.format(recipe=work / "recipe.yaml") for f in ROWS[name])
        subprocess.run([*CLI, *flags, *QUICK, "-o", str(out)], check=True)
    row: dict[str, Any] = {"name": name, "repeats": args.repeats}
    with torch.no_grad():
        for loader, load in LOADERS.items():
            _timed(load, out)  # warm: page cache, imports, the compiled kernels
            on, off = [], []
            for repeat in range(args.repeats):
                for checked in (True, False) if repeat % 2 == 0 else (False, True):
                    with contextlib.nullcontext() if checked else checks_off():
                        (on if checked else off).append(_timed(load, out))
            row[loader] = {
                "checked_s": round(statistics.median(on), 3),
                "unchecked_s": round(statistics.median(off), 3),
                "ratio": round(statistics.median(on) / statistics.median(off), 2),
            }
    return row


def render(payload: dict[str, Any]) -> str:
    rows = []
    for r in payload["results"]:
        cells = [r["name"]]
        for loader in LOADERS:
            m = r[loader]
            cells += [m["checked_s"], m["unchecked_s"], f"{m['ratio']:.2f}×"]
        rows.append(cells)
    header = ["export (format)"]
    for loader in LOADERS:
        header += [f"{loader} s", "without checks s", "ratio"]
    machine = payload.get("machine", {})
    return (
        "# What verifying an export costs at load (`python -m benchmarks.load_checks`)\n\n"
        "SmolLM2-135M exports (`--no-dense-copy`, fp32), loaded with the load-time checks and "
        "with them replaced by no-ops, interleaved in one process; medians of "
        f"{payload['results'][0]['repeats'] if payload['results'] else '?'} loads each. "
        f"Host: {machine.get('cpu_model')} ({', '.join(machine.get('isa') or [])}), "
        f"{payload.get('threads')} threads, torch {machine.get('torch')}.\n\n"
        + markdown_table(header, rows)
    )


def record(args: argparse.Namespace, rows: list[dict]) -> dict[str, Any]:
    return {"repeats": args.repeats, "threads": torch.get_num_threads(), "results": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_harness_args(parser, "rerun just these exports (names as in the table)")
    parser.add_argument("--repeats", type=int, default=5, help="loads per loader and setting")
    table = row_table(NAME, render, list(ROWS), run_row, record)
    return run_table(table, parser.parse_args(argv), parser)


if __name__ == "__main__":
    sys.exit(main())
