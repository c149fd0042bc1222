"""Inference speed of every compressed runtime against the dense model, on SmolLM2-135M.

    python -m benchmarks.speed                 # exports, then one `compress-model bench`
    python -m benchmarks.speed --render-only   # redraw speed.md / speed_curves.png
    python -m benchmarks.speed --exports int4 "2:4 + int4" --results-dir DIR  # some rows

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
For every row that misses a goal, ``benchmarks.speed_profile --buckets`` then says where its
prefill and decode time goes, module by module, beside the dense bf16 model's
(``profile`` in the JSON, "Where the time goes" in the md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from benchmarks.harness import Table, add_harness_args, run_table
from benchmarks.runner import CLI, STDOUT, Job, run_job, slug
from lmcompress.compressor.io.speed_report import plot_speed, speed_table

NAME = "speed"
RTN4 = ("--method", "rtn", "--bits", "4", "--group-size", "64")
JOINT = ("--method", "gptq", "--sparsity", "2:4", "--bits", "4", "--group-size", "64")
# name, compress-model flags (an export per stored format and save dtype)
EXPORTS = [
    ("2:4 fp32", ("--method", "magnitude", "--sparsity", "2:4")),
    ("2:4 bf16", ("--method", "magnitude", "--sparsity", "2:4", "--save-dtype", "bfloat16")),
    ("svd 0.8 fp32", ("--method", "svd", "--ratio", "0.8")),
    ("svd 0.8 bf16", ("--method", "svd", "--ratio", "0.8", "--save-dtype", "bfloat16")),
    ("int8", ("--method", "int8")),
    ("int8, int8 head", ("--method", "int8", "--head", "int8")),
    ("2:4 + int8", ("--config", "recipes/magnitude24-int8.yaml")),
    # 4-bit weights (issue 40): round to nearest writes GPTQ's format (int4) at no calibration
    # cost; the joint 2:4 + 4-bit export (nm_packed_int4) needs GPTQ's pass, on few windows
    ("int4", RTN4),
    ("int4 bf16", (*RTN4, "--save-dtype", "bfloat16")),
    ("int4, int4 head", (*RTN4, "--head", "quantized")),
    ("int4 bf16, int4 head", (*RTN4, "--head", "quantized", "--save-dtype", "bfloat16")),
    ("2:4 + int4", (*JOINT, "--nsamples", "16")),
    ("2:4 + int4 bf16", (*JOINT, "--nsamples", "16", "--save-dtype", "bfloat16")),
]
# where time goes (benchmarks.speed_profile --buckets): bucket -> what its time is, in the
# order the tables show them
BUCKETS = {
    "compressed linears": "the decoder's compressed layers, their kernels included",
    "dense linears": "the decoder's nn.Linear layers: all of them in a dense model",
    "lm_head": "the output projection to the vocabulary",
    "attention": "attention without its projections: rotary, cache, sdpa",
    "mlp activation": "the MLP without its projections: silu × up",
    "norms": "RMSNorm",
    "other": "embedding, residual adds, the model's Python between modules",
}

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
    # issue 40's
    ("int4", "decode", 2.5),
    ("int4", "prefill", 0.9),
    ("int4 bf16", "decode", 2.5),
    ("int4 bf16", "prefill", 0.9),
    ("int4, int4 head", "decode", 2.5),
    ("int4, int4 head", "prefill", 0.9),
    ("int4 bf16, int4 head", "decode", 2.5),
    ("int4 bf16, int4 head", "prefill", 0.9),
]
# (row, the row whose decode it must reach): 2:4 on top of a quantization must not be slower
PAIRS = [
    ("2:4 + int8", "int8"),
    ("2:4 + int8 (expanded)", "int8"),
    ("2:4 + int4", "int4"),
    ("2:4 + int4 bf16", "int4 bf16"),
]
# the expanded runtime (packed N:M unpacked once) beside each export's packed one
RUNTIMES = ("packed", "expanded")


def export_job(name: str, flags: tuple[str, ...], out: Path, checkpoint: str) -> Job:
    command = (*CLI, checkpoint, *flags, "--eval", "--overwrite", "-o", str(out), "-q")
    return Job(f"export {name}", command, out / "compression.json")


def measure(args: argparse.Namespace, _names: list[str], _previous: dict) -> Any:
    outputs = args.work / "outputs"
    exports, chosen = [], [(n, f) for n, f in EXPORTS if not args.exports or n in args.exports]
    for name, flags in chosen:
        out = outputs / slug(name)
        run_job(export_job(name, flags, out, args.checkpoint), args.work)
        exports.append((name, out))
    command = [*CLI, "bench", args.checkpoint, *(str(out) for _, out in exports)]
    command += ["--prefill", args.prefill, "--decode", str(args.decode)]
    command += ["--repeats", str(args.repeats), "--runtime", *RUNTIMES, "--json", "-q"]
    command += ["--compile"] * args.compile + ["--lean"] * args.lean
    run = run_job(Job("bench", command, STDOUT), args.work)
    record = run.result
    names = {str(out): name for name, out in exports}
    for row in record["rows"]:  # the export's job name, not its directory's
        row["name"] = export_name(row["name"], names)
    record["exports"] = {name: " ".join(flags) for name, flags in chosen}
    record["bench_wall_seconds"] = run.wall_seconds
    record["bench_peak_rss_mb"] = run.peak_rss_mb
    yield record
    missed = [name for name in missed_goals(record) if name in dict(exports)]
    if missed:
        command = [sys.executable, "-m", "benchmarks.speed_profile", "--buckets"]
        command += [args.checkpoint, *(str(dict(exports)[name]) for name in missed)]
        command += ["--prefill", args.prefill, "--steps", str(args.decode)]
        profiled = run_job(Job("profile", command, STDOUT), args.work).result
        by_path = {args.checkpoint: "dense bfloat16", **{str(dict(exports)[n]): n for n in missed}}
        profiled["models"] = {by_path[path]: v for path, v in profiled["models"].items()}
        record["profile"] = profiled
        yield record


def missed_goals(record: dict[str, Any]) -> dict[str, set[str]]:
    """The rows (packed runtime, eager) below a goal of :data:`GOALS` or slower at decode than
    the row of :data:`PAIRS` they must beat, in their order: row -> the measures missed
    (``prefill``, ``decode``)."""
    rows = {r["name"]: r for r in record["rows"] if not (r.get("compiled") or r.get("lean"))}
    missed: dict[str, set[str]] = {}
    for name, what, target in GOALS:
        value = rows.get(name, {}).get(f"{what}_vs_best_dense")
        if value is not None and value < target:
            missed.setdefault(name, set()).add(what)
    for name, base in PAIRS:
        row, other = rows.get(name), rows.get(base)
        if row and other and row["decode_tokens_per_s"] < other["decode_tokens_per_s"]:
            missed.setdefault(name, set()).add("decode")
    return missed


# what would close each miss, by export (the profile gives the numbers)
REMEDIES = {
    "int8": "The fp32 lm_head (113 MB read per decoded token, a third of the prefill) is most "
    "of what separates it from `int8, int8 head`; see that row.",
    "int8, int8 head": "Prefill: beside `_int_mm`, each layer quantizes its input in a pass "
    "of its own and rescales its int32 products in another (the compiled kernels' passes; "
    "the lm_head's products by cache-sized blocks); an int8 GEMM with the quantization in its "
    "prologue and the rescale in its epilogue (oneDNN's, or a blocked VNNI kernel of ours) "
    "would leave the compressed linears at their `_int_mm` time.",
    "svd 0.8 bf16": "Prefill: the compressed linears keep 80 % of the parameters, so at "
    "best they run 1.25× the dense ones, and attention, norms and the bf16 lm_head are "
    "unchanged: 1.15× for the model needs a lower ratio. Rounding the ranks to multiples of "
    "16–64 gives no more speed per parameter here (`benchmarks.layer_speed`).",
    "2:4 + int8": "At one token the int8 kernels spend about as long in the call (Python, "
    "ctypes, starting the threads) as in the arithmetic, and 2:4's gather of its "
    "activations costs the instructions its 40 % fewer weight bytes save: the packed and "
    "dense int8 kernels run at the same speed (`benchmarks.layer_speed`). A C++ extension "
    "calling the kernels without Python in between, or one kernel per decoder block, "
    "would let the bytes show.",
    "2:4 bf16": "Prefill unpacks each layer once per call before torch's matmul: the "
    "unpacking is the difference from the expanded runtime.",
    "2:4 bf16 (expanded)": "Not profiled: the expanded runtime is the dense layers by design "
    "(2:4's decode goal is the packed runtime's).",
    "int4": "Prefill: an fp32 export computes in fp32, a third of bf16's speed here, as the "
    "dense fp32 row does; `int4 bf16` is the row to read. Decode: as `int4 bf16, int4 head`.",
    "int4 bf16": "Decode: beside its int4 layers it reads the bf16 lm_head (57 MB a token) "
    "through torch's bf16 matrix-vector product, far from the bandwidth; see "
    "`int4 bf16, int4 head`.",
    "int4, int4 head": "As `int4` (fp32 prefill) and `int4 bf16, int4 head` (decode).",
    "int4 bf16, int4 head": "Decode: the int4 layers (tiled codes, 16 rows a vector; q/k/v and "
    "gate/up one call each) stream their codes at about the rate two cores read them (the "
    "host reports a 480 MiB L3, which holds them); the rest of the step, which no weight "
    "format shrinks (attention, norms, the model's Python between modules: the profile's other "
    "buckets), is about half of it. What would move it further is a runtime of the model's "
    "own (no transformers Python between the kernels), not the linears. Prefill: the int4 head "
    "dequantizes its 49152 x 576 weight by blocks every call.",
    "2:4 + int4": "As `2:4 + int4 bf16`.",
    "2:4 + int4 bf16": "Decode: packed 2:4 codes run the row kernel (a row at a time, a "
    "horizontal sum per group, each token's activations gathered by 2-bit positions); the "
    "dense codes' tiled kernel (16 rows in the lanes of one vector) has no counterpart for "
    "packed codes, whose positions differ from row to row: their 25 % fewer code bytes do not "
    "pay for the gathers.",
}


# the same on a CPU without AVX-512 (AVX2 only: benchmarks/results/speed_avx2), where the
# kernels run their AVX2 loops and bf16 matmuls have no native arithmetic
_BF16_PREFILL = (
    "Prefill: without bf16 arithmetic (AVX2 only) torch's bf16 matmuls run at about an "
    "eighth of fp32's speed (dense bf16 against dense fp32 in the table above), so the "
    "compressed layers and the runtime's plain linears (the head) compute a bf16 prefill in "
    "fp32 (`kernels/gemm_dtype.py`, `compressor/model/bf16_prefill.py`); what is left over "
    "the fp32 rows is converting each block of weight, the activations and the products, "
    "and the bf16 attention and norms."
)
_REST_OF_STEP = (
    "the rest of the step (attention, norms, the model's Python: the profile's other buckets) "
    "is unchanged, about half of dense bf16's: even linears several times faster leave a "
    "model at about 1.5× dense"
)
_INT4_DECODE = (
    "Decode: the int4 layers run 1.5-4.6× the best dense row at one token by shape, 1.4× over "
    "SmolLM2's 210 small linears, where each call's fixed cost shows "
    "(`benchmarks/results/int4_speed_avx2`); " + _REST_OF_STEP + "."
)
REMEDIES_AVX2: dict[str, str | dict[str, str]] = {
    "int8, int8 head": {
        "prefill": "Prefill: the int8 products are the compiled kernel's (torch's `_int_mm` "
        "has no fast path without VNNI), a few-token loop by blocks of 64 tokens, not a "
        "blocked GEMM: well below fp32's BLAS.",
        "decode": "Decode: " + _REST_OF_STEP + ".",
    },
    "svd 0.8 bf16": {
        "prefill": _BF16_PREFILL,
        "decode": "Decode: 80 % of the parameters, and " + _REST_OF_STEP + ".",
    },
    "2:4 bf16": {
        "prefill": _BF16_PREFILL,
        "decode": "Decode: the AVX2 2:4 loop (8 kept values a step, two vpermps and a blend "
        "a token) needs about twice dense's instructions per input for 0.56× its bytes: the "
        "210 linears at one token run at about dense bf16's speed "
        "(`benchmarks/results/layer_speed_avx2`).",
    },
    "int4": {"decode": _INT4_DECODE},  # (an fp32 prefill here runs at dense fp32's speed)
    "int4, int4 head": {"decode": _INT4_DECODE},
    "int4 bf16": {"prefill": _BF16_PREFILL, "decode": _INT4_DECODE},
    "int4 bf16, int4 head": {"prefill": _BF16_PREFILL, "decode": _INT4_DECODE},
    "2:4 + int4 bf16": "Decode: in the stored layout the AVX2 loop (16 kept values a step, "
    "their activations gathered by two vpshufb, a horizontal sum per group) took 2.4-3.3× the "
    "int4 tiled loop's time per layer; held tiled (`kernels/int4_tiles24.py`: one vpermd and "
    "one vpmaddwd per 4 inputs, int4 two vpmaddwd per 4) it takes about int4's, the same "
    "shifts and masks per code bound both (`benchmarks/results/int4_speed_avx2`, both "
    "layouts' columns).",
}


def export_name(row: str, names: dict[str, str]) -> str:
    """A bench row's name (``DIR``, ``DIR (runtime)``, ``... compiled``, ``... lean``) with the
    export's job name for its directory (``names``: directory -> job name)."""
    mode = next((m for m in (" compiled", " lean") if row.endswith(m)), "")
    directory, paren, runtime = row.removesuffix(mode).partition(" (")
    name = next((n for p, n in names.items() if p.endswith("/" + directory)), directory)
    return name + paren + runtime + mode


def goals(record: dict[str, Any], suffix: str = "") -> str:
    """The goals table of the rows named ``NAME + suffix`` (``" compiled"``: compiled rows,
    each against the best compiled dense row; ``" lean"``: the lean step's rows)."""
    rows = {
        row["name"].removesuffix(suffix): row
        for row in record["rows"]
        if row["name"].endswith(suffix)
        and (row.get("compiled", False), row.get("lean", False))
        == (suffix == " compiled", suffix == " lean")
    }
    lines = ["| goal | measured | met |", "|---|---|---|"]
    for name, what, target in GOALS:
        if name not in rows:  # a row this run did not measure (an older file)
            continue
        value = rows[name].get(f"{what}_vs_best_dense")
        shown = f"{value:.2f}×" if value is not None else "-"
        met = "yes" if value is not None and value >= target else "**no**"
        lines.append(f"| {name} {what} ≥ {target}× best dense | {shown} | {met} |")
    for name, base in PAIRS:
        both, other = rows.get(name), rows.get(base)
        if other and both:
            ok = both["decode_tokens_per_s"] >= other["decode_tokens_per_s"]
            ratio = both["decode_tokens_per_s"] / other["decode_tokens_per_s"]
            lines.append(
                f"| {name} decode ≥ {base} decode | {ratio:.2f}× | {'yes' if ok else '**no**'} |"
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
        + "\n\nIssue 22's and issue 40's goals, each against the best dense row of its column:\n\n"
        + goals(record)
        + (
            "\nCompiled (`torch.compile`, static KV cache), each against the best compiled "
            "dense row:\n\n" + goals(record, " compiled")
            if any(row.get("compiled") for row in record["rows"])
            else ""
        )
        + (
            "\nThrough the lean decode step (`--lean`: the layers' own linears, the rest of the "
            "step in a few kernels), each against the best lean dense row:\n\n"
            + goals(record, " lean")
            if any(row.get("lean") for row in record["rows"])
            else ""
        )
        + (
            where_the_time_goes(record["profile"], missed_goals(record), _isa(record))
            if "profile" in record
            else ""
        )
    )


def _isa(record: dict[str, Any]) -> list[str]:
    return (record.get("machine") or {}).get("isa") or []


def remedy(text: str | dict[str, str], measures: set[str]) -> str:
    """A remedy: the whole text, or of one given by measure the parts of ``measures``."""
    if isinstance(text, str):
        return text
    return " ".join(text[m] for m in ("prefill", "decode") if m in measures and m in text)


def where_the_time_goes(
    profile: dict[str, Any], missed: dict[str, set[str]], isa: list[str]
) -> str:
    """Milliseconds by module for dense bf16 and each row that misses a goal (``missed``: row
    -> measures); the remedies of a host without AVX-512 where ``isa`` (its flags) says so,
    of the measures each row misses."""
    remedies = REMEDIES
    if isa and not any(flag.startswith("avx512") for flag in isa):
        remedies = {**REMEDIES, **REMEDIES_AVX2}

    names = list(profile["models"])
    lines = [
        "\n## Where the time goes (rows that miss a goal)\n",
        f"`python -m benchmarks.speed_profile --buckets`: one {profile['prefill']} prefill and "
        f"{profile['decode_steps']} decode steps under `torch.profiler`, milliseconds by the "
        "module they ran in (each module less the modules inside it; profiling adds "
        "overhead, so compare the columns, not the totals, with the table above).\n",
    ]
    phases = (("prefill, ms", "prefill_ms"), ("decode, ms per step", "decode_ms_per_step"))
    for phase, key in phases:
        lines += ["", f"| {phase} | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        for bucket, meaning in BUCKETS.items():
            cells = [f"{profile['models'][n][key][bucket]:.1f}" for n in names]
            lines.append(f"| {bucket} ({meaning}) | " + " | ".join(cells) + " |")
        totals = [f"{sum(profile['models'][n][key].values()):.1f}" for n in names]
        lines.append("| total | " + " | ".join(totals) + " |")
    lines.append("\nWhat would close each miss:\n")
    texts = {n: remedy(remedies[n], measures) for n, measures in missed.items() if n in remedies}
    lines += [f"- **{n}**: {text}" for n, text in texts.items() if text]
    return "\n".join(lines) + "\n"


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
    parser.add_argument(
        "--lean", action="store_true", help="also time every row through the lean decode step"
    )
    parser.add_argument(
        "--exports", nargs="+", choices=[name for name, _ in EXPORTS], metavar="NAME",
        help="bench only these exports beside the dense rows (default: all)",
    )  # fmt: skip
    add_harness_args(parser)
    table = Table(NAME, render, measure, plot=plot)
    return run_table(table, parser.parse_args(argv), parser)


if __name__ == "__main__":
    sys.exit(main())
