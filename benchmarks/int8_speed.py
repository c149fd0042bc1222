"""int8 speed on this CPU: one forward of 8 × 512 SmolLM2-135M tokens, side by side in one process.

    PYTHONPATH=.venv-torchao python -m benchmarks.int8_speed         # every row, twice
    python -m benchmarks.int8_speed --render-only                     # redraw the md

torchao is the peer and a benchmark-only dependency, kept out of ``.venv`` (transformers imports
torchao whenever it is installed, which adds ~1.3 s and two warnings to every process):

    .venv/bin/pip install --target .venv-torchao --no-deps torchao==0.18.0

Rows (all from the same fp32 weights, ``torch.set_num_threads(threads)``, ``inference_mode``,
``use_cache=False``): fp32; bf16 (``model.to(bfloat16)``); ours (``compress(model,
Int8Config())``: int8 weights per channel, dynamic per-token int8 activations, path ``int``, i.e.
``torch.ops.lmcompress.int8_linear`` over ``torch._int_mm``); torchao's
``Int8DynamicActivationInt8WeightConfig`` (the same scheme); both int8 models again under
``torch.compile`` (compile time reported). Only the decoder linears are quantized in both;
``lm_head`` stays fp32. The machine is shared, so the rows are timed interleaved (one forward of
each row per round, ``repeats`` rounds after ``warmup`` ones) and the median is reported; the
whole measurement runs ``--runs`` times with the load average noted before and after each.

A CPU profile (``torch.profiler``) of one eager forward of fp32 and of ours says where the time
goes, bucketed by the module each op ran in (forward hooks open a ``record_function`` range per
module; see :func:`bucket`). The compiled CPU kernels (:mod:`lmcompress.kernels.cpu_kernels`)
are no torch ops: their time is the int8 layers' own (``KERNELS``).
Writes ``benchmarks/results/int8_speed.{json,md}``.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity
from torch.profiler import profile as torch_profile

from benchmarks.harness import Table, add_harness_args, run_table
from benchmarks.render import markdown_table
from benchmarks.speed_profile import module_ranges
from lmcompress.api import compress
from lmcompress.compressor.model.loading import load_model
from lmcompress.evaluation.corpora import tokenize
from lmcompress.methods.int8 import Int8Config

log = logging.getLogger(__name__)

NAME = "int8_speed"
ROWS = ("fp32", "bf16", "int8 (ours)", "int8 (ours) + compile", "torchao", "torchao + compile")
SCOPES = {  # module class -> profile scope, for the class names the families use
    "QuantLinear": "int8 linear",
    "Linear": "linear",
    "Attention": "attention",
    "MLP": "mlp",
    "RMSNorm": "norm",
}
INT8_OP = "lmcompress::int8_linear"
# the int8 layers' own time outside torch ops: the compiled CPU kernels (quantization, rescale,
# and at few tokens the whole layer, called through ctypes) and the layer's Python
KERNELS = "int8 layer outside torch ops (compiled CPU kernels, Python)"
# what int8_ops.linear runs after _int_mm (the quantization divides, rounds and clamps)
RESCALE_OPS = ("aten::mul", "aten::mul_", "aten::addcmul", "aten::add_")


def bucket(op: str, scopes: tuple[str, ...]) -> str:
    """Where an op's self time goes: ``op`` is the profiler's name (``aten::mm``), ``scopes``
    the ranges it ran in, outermost first (module scopes and enclosing ops)."""
    if INT8_OP in scopes:
        return "int8 matmul (torch._int_mm)" if op == "aten::_int_mm" else "rescale + bias (fp32)"
    modules = [s for s in scopes if not s.startswith(("aten::", "lmcompress::"))]
    inner = modules[-1] if modules else ""
    if inner == "int8 linear" and op == "aten::_int_mm":
        return "int8 matmul (torch._int_mm)"
    if inner == "int8 linear" and op in RESCALE_OPS:
        return "rescale + bias (fp32)"
    if inner == "int8 linear":
        return "quantize activations (absmax, round, clamp, to int8)"
    if inner == "lm_head":
        return "lm_head (fp32 matmul)"
    if inner == "linear":
        return "linear (float matmul)"
    if inner == "attention":
        return "attention (sdpa)" if "scaled_dot_product" in op else "rotary embedding, reshapes"
    if inner == "mlp":
        return "MLP activation (silu × up)"
    if inner == "norm":
        return "RMSNorm"
    return "embedding, residual adds, other"


def scope_of(name: str, module: nn.Module) -> str | None:
    if name == "lm_head":
        return "lm_head"
    kind = type(module).__name__
    for suffix, scope in SCOPES.items():
        if kind == suffix or (suffix != "Linear" and kind.endswith(suffix)):
            return scope
    return None


def profile(model: nn.Module, ids: torch.Tensor) -> dict[str, float]:
    """Self CPU milliseconds of one forward, per :func:`bucket`."""
    with module_ranges(model, scope_of), torch.inference_mode():
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            model(ids, use_cache=False)
    labels = set(SCOPES.values()) | {"lm_head"}
    times: dict[str, float] = {}
    for event in prof.events():
        if event.name == "int8 linear":  # time in no torch op: the compiled CPU kernels' calls
            own = event.self_cpu_time_total / 1e3
            times[KERNELS] = times.get(KERNELS, 0.0) + own
        if event.name in labels:
            continue
        scopes, parent = [], event.cpu_parent
        while parent is not None:
            scopes.append(parent.name)
            parent = parent.cpu_parent
        key = bucket(event.name, tuple(reversed(scopes)))
        times[key] = times.get(key, 0.0) + event.self_cpu_time_total / 1e3
    return dict(sorted(times.items(), key=lambda kv: -kv[1]))


def torchao_version() -> str | None:
    try:
        import torchao
    except ImportError:
        return None
    return torchao.__version__


def build_rows(model: nn.Module, names: list[str]) -> dict[str, Callable[[], Any]]:
    """``{row: model}`` for the rows asked (torchao's only where it is importable)."""
    models: dict[str, Any] = {"fp32": model}
    if "bf16" in names:
        models["bf16"] = copy.deepcopy(model).to(torch.bfloat16)
    if any(n.startswith("int8") for n in names):
        models["int8 (ours)"] = copy.deepcopy(model)
        compress(models["int8 (ours)"], Int8Config())
    if any(n.startswith("torchao") for n in names):
        if torchao_version() is None:
            log.warning("torchao is not importable: no torchao rows (see the module docstring)")
        else:
            from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

            models["torchao"] = copy.deepcopy(model)
            quantize_(
                models["torchao"],
                Int8DynamicActivationInt8WeightConfig(),
                filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and fqn != "lm_head",
            )
    for name in names:
        base = name.removesuffix(" + compile")
        if name != base and base in models:
            models[name] = torch.compile(models[base])
    return {name: models[name] for name in names if name in models}


def measure(settings: dict[str, Any], rows: dict[str, Any], ids: torch.Tensor) -> dict[str, Any]:
    """One interleaved measurement: warm-up rounds (the first one compiles), then ``repeats``
    rounds of one forward per row; seconds per forward, median, tokens/s."""

    def forward(model: nn.Module) -> float:
        start = time.perf_counter()
        model(ids, use_cache=False)
        return time.perf_counter() - start

    load_before = os.getloadavg()
    first: dict[str, float] = {}
    seconds: dict[str, list[float]] = {name: [] for name in rows}
    with torch.inference_mode():
        for round_ in range(settings["warmup"] + settings["repeats"]):
            for name, model in rows.items():
                took = forward(model)
                log.info("round %d %s: %.2f s", round_, name, took)
                if round_ == 0:
                    first[name] = took
                elif round_ >= settings["warmup"]:
                    seconds[name].append(took)
    tokens = ids.numel()
    results = {}
    for name, times in seconds.items():
        median = statistics.median(times)
        results[name] = {
            "seconds": [round(t, 4) for t in times],
            "median_seconds": round(median, 4),
            "tokens_per_second": round(tokens / median, 1),
            "first_forward_seconds": round(first[name], 2),  # compiles, for compiled rows
        }
    return {"loadavg_before": load_before, "loadavg_after": os.getloadavg(), "rows": results}


def render(payload: dict[str, Any]) -> str:
    s = payload["settings"]
    runs = payload["runs"]
    tokens = s["batch"] * s["seq_len"]
    header = ["row"]
    for i, _ in enumerate(runs, 1):
        header += [f"run {i} tokens/s", f"run {i} × fp32"]
    header += ["first forward s (run 1)"]
    table = []
    for name in [n for n in ROWS if n in runs[0]["rows"]]:
        cells = [name]
        for run in runs:
            got = run["rows"][name]
            ratio = got["tokens_per_second"] / run["rows"]["fp32"]["tokens_per_second"]
            cells += [f"{got['tokens_per_second']:.0f}", f"{ratio:.2f}"]
        table.append([*cells, f"{runs[0]['rows'][name]['first_forward_seconds']:.1f}"])
    loads = ", ".join(
        f"run {i}: {r['loadavg_before'][0]:.2f} → {r['loadavg_after'][0]:.2f}"
        for i, r in enumerate(runs, 1)
    )
    goal = []
    for i, run in enumerate(runs, 1):
        speed = {name: got["tokens_per_second"] for name, got in run["rows"].items()}
        if "int8 (ours)" in speed:
            peer = (
                f", {speed['int8 (ours)'] / speed['torchao']:.2f}× torchao"
                if "torchao" in speed
                else ""
            )
            goal.append(f"run {i}: {speed['int8 (ours)'] / speed['fp32']:.2f}× fp32{peer}")
    m = payload["machine"]
    text = (
        f"Forward of {s['batch']} × {s['seq_len']} = {tokens} tokens of SmolLM2-135M "
        f"({s['checkpoint']}, {s['corpus']} token ids), `use_cache=False`, inference mode; "
        f"{s['threads']} torch threads on {m['cpu_count']} cores, torch {m['torch']}, torchao "
        f"{s['torchao']}. One process; the rows are timed interleaved, median of "
        f"{s['repeats']} forwards after {s['warmup']} warm-up round(s). Only the decoder "
        "linears are int8 in both int8 rows; lm_head stays fp32. The machine is shared: "
        f"1-minute load average {loads} (on {m['cpu_count']} cores).\n\n"
        + markdown_table(header, table)
    )
    if goal:
        text += f"\nOurs (goal: ≥ 1.5× fp32, ≥ 1× torchao): {'; '.join(goal)}.\n"
    profiles = payload.get("profile", {})
    if profiles:
        names = list(profiles)
        buckets = sorted(
            {b for p in profiles.values() for b in p},
            key=lambda b: -max(p.get(b, 0.0) for p in profiles.values()),
        )
        totals = {n: sum(profiles[n].values()) for n in names}
        rows = [
            [
                b,
                *(
                    f"{profiles[n].get(b, 0.0):.0f} ({profiles[n].get(b, 0.0) / totals[n]:.0%})"
                    for n in names
                ),
            ]
            for b in buckets
        ]
        rows.append(["total", *(f"{totals[n]:.0f}" for n in names)])
        text += (
            f"\nWhere the time goes: self CPU ms of one eager forward ({tokens} tokens) under "
            "`torch.profiler`, each op counted in the innermost module it ran in (profiling "
            "adds overhead; compare the shares, not the totals, with the table above).\n\n"
            + markdown_table(["bucket", *names], rows)
        )
    return text


def measure_all(args: argparse.Namespace, names: list[str], _previous: dict) -> Iterator[dict]:
    """The rows asked (never merged with an earlier run: a run is one side by side), timed
    ``--runs`` times, then profiled; the record after each."""
    timed = [n for n in names if args.compile or not n.endswith(" + compile")]
    names = ["fp32", *(n for n in timed if n != "fp32")]
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.checkpoint)
    tokens = args.batch * args.seq_len
    ids = tokenize(tokenizer, args.corpus, tokens).view(args.batch, args.seq_len)
    rows = build_rows(model, names)
    settings = {
        "checkpoint": args.checkpoint,
        "corpus": args.corpus,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "threads": torch.get_num_threads(),
        "warmup": args.warmup,
        "repeats": args.repeats,
        "torchao": torchao_version(),
    }
    payload: dict[str, Any] = {"settings": settings, "runs": []}
    for run in range(args.runs):
        log.info("run %d of %d", run + 1, args.runs)
        payload["runs"].append(measure(settings, rows, ids))
        yield payload
    if not args.no_profile:
        profiled = [name for name in ("fp32", "int8 (ours)") if name in rows]
        payload["profile"] = {name: profile(rows[name], ids) for name in profiled}
        yield payload


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="smollm2-135m")
    parser.add_argument("--corpus", default="wiki-test")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds (>= 1)")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds; the median")
    parser.add_argument("--runs", type=int, default=2, help="whole measurements, for stability")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="add the torch.compile rows (each compiles for ~5 min on 2 busy cores)",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        default=[],
        metavar="ROW",
        help="time just these rows (not merged: a run is one side by side)",
    )
    add_harness_args(parser, work=False)
    args = parser.parse_args(argv)
    if args.warmup < 1 or args.repeats < 1 or args.runs < 1:
        parser.error("--warmup, --repeats and --runs must be at least 1")
    return run_table(Table(NAME, render, measure_all, jobs=ROWS), args, parser)


if __name__ == "__main__":
    sys.exit(main())
