"""Inference speed of every compressed runtime against the dense model, on SmolLM2-135M.

    python -m benchmarks.speed                 # exports, then one `compress-model bench`
    python -m benchmarks.speed --render-only   # redraw speed.md / speed_curves.png

One export per stored format, made with the fastest method that writes it (the speed of a
runtime depends on its format, dtype and shapes, not on how the weights were chosen): magnitude
2:4 (``nm_packed``: SparseGPT and MaskLLM 2:4 write the same), plain SVD at ratio 0.8
(``low_rank``: the same ranks as FWSVD/GFWSVD with uniform allocation), int8 W8A8 dynamic
(``int8``), and 2:4 then int8 (``nm_packed_int8``). Each is exported at fp32 (the default save
dtype of an fp32 run) and, where the format has floating weights, at bf16 too. Then one
``compress-model bench`` process times the dense model at fp32 and bf16 and every export in
its compressed runtime, rows interleaved, median of the repeats
(:mod:`lmcompress.evaluation.speed`). The table gives each row against the best dense row,
beside the goals of issue 22, with the host's CPU flags and the measured memory bandwidth.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from benchmarks.harness import Table, add_harness_args, run_table
from benchmarks.runner import CLI, STDOUT, Job, run_job
from lmcompress.evaluation.speed_report import plot_speed, speed_table

NAME = "speed"
# name, compress-model flags (an export per stored format and save dtype)
EXPORTS = [
    ("2:4 fp32", ("--method", "magnitude", "--sparsity", "2:4")),
    ("2:4 bf16", ("--method", "magnitude", "--sparsity", "2:4", "--save-dtype", "bfloat16")),
    ("svd 0.8 fp32", ("--method", "svd", "--ratio", "0.8")),
    ("svd 0.8 bf16", ("--method", "svd", "--ratio", "0.8", "--save-dtype", "bfloat16")),
    ("int8", ("--method", "int8")),
    ("int8, int8 head", ("--method", "int8", "--head", "int8")),
    ("2:4 + int8", ("--config", "recipes/magnitude24-int8.yaml")),
]
# issue 22's goals: (row, measure, at least this × the best dense row)
GOALS = [
    ("int8", "prefill", 1.3),
    ("int8", "decode", 2.0),
    ("int8, int8 head", "prefill", 1.3),
    ("int8, int8 head", "decode", 2.0),
    ("svd 0.8 bf16", "prefill", 1.15),
    ("svd 0.8 bf16", "decode", 1.15),
    ("2:4 bf16", "prefill", 0.9),
    ("2:4 bf16", "decode", 1.3),
    ("2:4 bf16 (expanded)", "prefill", 0.9),
    ("2:4 bf16 (expanded)", "decode", 1.3),
]
# the expanded runtime (packed N:M unpacked once) beside each export's packed one
RUNTIMES = ("packed", "expanded")


def export_job(name: str, flags: tuple[str, ...], out: Path, checkpoint: str) -> Job:
    command = (*CLI, checkpoint, *flags, "--eval", "--overwrite", "-o", str(out), "-q")
    return Job(f"export {name}", command, out / "compression.json")


def measure(args: argparse.Namespace, _names: list[str], _previous: dict) -> Any:
    outputs = args.work / "outputs"
    exports = []
    for name, flags in EXPORTS:
        out = outputs / name.replace(",", "").replace(" ", "_").replace(":", "of").replace(
            "+", "and"
        )
        run_job(export_job(name, flags, out, args.checkpoint), args.work)
        exports.append((name, out))
    command = [*CLI, "bench", args.checkpoint, *(str(out) for _, out in exports)]
    command += ["--prefill", args.prefill, "--decode", str(args.decode)]
    command += ["--repeats", str(args.repeats), "--runtime", *RUNTIMES, "--json", "-q"]
    if args.compile:
        command.append("--compile")
    run = run_job(Job("bench", command, STDOUT), args.work)
    record = run.result
    names = {str(out): name for name, out in exports}
    for row in record["rows"]:  # the export's job name, not its directory's
        row["name"] = export_name(row["name"], names)
    record["exports"] = {name: " ".join(flags) for name, flags in EXPORTS}
    record["bench_wall_seconds"] = run.wall_seconds
    record["bench_peak_rss_mb"] = run.peak_rss_mb
    yield record


def export_name(row: str, names: dict[str, str]) -> str:
    """A bench row's name (``DIR``, ``DIR (runtime)``, ``... compiled``) with the export's job
    name for its directory (``names``: directory -> job name)."""
    row, compiled, _ = row.partition(" compiled")
    directory, paren, runtime = row.partition(" (")
    name = next((n for p, n in names.items() if p.endswith("/" + directory)), directory)
    return name + paren + runtime + compiled


def goals(record: dict[str, Any], suffix: str = "") -> str:
    """The goals table of the rows named ``NAME + suffix`` (``" compiled"``: compiled rows,
    each against the best compiled dense row)."""
    rows = {
        row["name"].removesuffix(suffix): row
        for row in record["rows"]
        if row["name"].endswith(suffix) and row.get("compiled", False) == bool(suffix)
    }
    lines = ["| goal | measured | met |", "|---|---|---|"]
    for name, what, target in GOALS:
        value = rows.get(name, {}).get(f"{what}_vs_best_dense")
        shown = f"{value:.2f}×" if value is not None else "-"
        met = "yes" if value is not None and value >= target else "**no**"
        lines.append(f"| {name} {what} ≥ {target}× best dense | {shown} | {met} |")
    int8 = rows.get("int8")
    for name in ("2:4 + int8", "2:4 + int8 (expanded)"):
        both = rows.get(name)
        if int8 and both:
            ok = both["decode_tokens_per_s"] >= int8["decode_tokens_per_s"]
            ratio = both["decode_tokens_per_s"] / int8["decode_tokens_per_s"]
            lines.append(
                f"| {name} decode ≥ int8 decode | {ratio:.2f}× | {'yes' if ok else '**no**'} |"
            )
    return "\n".join(lines) + "\n"


def render(record: dict[str, Any]) -> str:
    exports = "\n".join(
        f"- {name}: `compress-model {flags}`" for name, flags in record["exports"].items()
    )
    return (
        speed_table(record)
        + "\nExports (SmolLM2-135M, every decoder linear):\n\n"
        + exports
        + "\n\nIssue 22's goals, each against the best dense row of its column:\n\n"
        + goals(record)
        + (
            "\nCompiled (`torch.compile`, static KV cache), each against the best compiled "
            "dense row:\n\n" + goals(record, " compiled")
            if any(row.get("compiled") for row in record["rows"])
            else ""
        )
    )


def plot(record: dict[str, Any], _results_dir: Path, path: Path) -> None:
    plot_speed(record, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="smollm2-135m")
    parser.add_argument("--prefill", default="4x256", help="BATCHxTOKENS")
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--compile", action="store_true", help="also time every row under torch.compile"
    )
    add_harness_args(parser)
    table = Table(NAME, render, measure, plot=plot)
    return run_table(table, parser.parse_args(argv), parser)


if __name__ == "__main__":
    sys.exit(main())
