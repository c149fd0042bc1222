"""The int4 runtime's speed (``lmcompress/kernels/int4_ops.py``) against dense ``F.linear`` in
fp32 and bf16, layer by layer, on SmolLM2-135M's decoder-linear shapes and a 1B-like shape:

    python -m benchmarks.int4_speed              # -> benchmarks/results/int4_speed.{json,md}
    python -m benchmarks.int4_speed --render-only

Random weights and codes; every implementation timed in each round (interleaved, one process),
median of the rounds:

- ``shapes``: batch-1 decode (and ``PREFILL_TOKENS`` prefill) of one layer shape, cycling over
  copies of the layer (``COLD_BYTES`` of fp32 weights in all: far more than L2), as in a model
  where each layer's weights are read once a token (from L3 or memory: a 480 MB L3, as on the
  host of the committed results, holds the bf16 and int4 copies);
- ``model``: one pass over all 210 of SmolLM2-135M's decoder linears (the lm_head is not
  quantized: not included) at 1–32 tokens: past the tiled decode kernel's token limit (16), and
  prefill's path (dequantized blocks, bf16 matmul) at every count, for the crossover;

``int4 fp32`` / ``int4 bf16`` read the codes tiled (``kernels/int4_tiles.py``: what an
``Int4Linear`` holds where the kernels are built), ``rows`` the stored layout (the row kernel,
what packed N:M codes and CPUs without the kernels keep).
- ``error``: the decode output against the float dequantized matmul, for int16 activations
  (what the kernel computes) and, for comparison, int8 activations per group (absmax / 127).

Group size 64 on SmolLM2's shapes (128 does not divide its 576 inputs), 128 on the 1B shape.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.harness import Table, add_harness_args, run_table
from lmcompress.compressor.sparsity import nm_mask
from lmcompress.kernels import int4_ops, int4_tiles, int4_tiles24
from lmcompress.kernels import int4_reference as R4
from lmcompress.kernels import reference as R

NAME = "int4_speed"
HIDDEN, INTERMEDIATE, KV, LAYERS = 576, 1536, 192, 30  # SmolLM2-135M
SMOL = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN)]
SMOL += [(INTERMEDIATE, HIDDEN), (INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]  # (out, in)
SHAPES = [(576, 576, 64), (1536, 576, 64), (576, 1536, 64), (8192, 2048, 128), (2048, 8192, 128)]
MODEL_TOKENS = (1, 2, 4, 8, 12, 16, 24, 32)
PREFILL_TOKENS = 512
COLD_BYTES = 256 << 20
# lmc_int4_vector(): which vector loops the kernels were built with on this host
VECTOR_LOOPS = {0: "none (plain loops)", 1: "AVX-512", 2: "AVX2"}


def int4_layer(out_features: int, in_features: int, group_size: int, g: torch.Generator) -> dict:
    groups = in_features // group_size
    q = torch.randint(0, 16, (out_features, in_features), dtype=torch.uint8, generator=g)
    W = torch.randn(out_features, in_features, generator=g) / in_features**0.5
    mask = nm_mask(torch.rand(out_features, in_features, generator=g), 2, 4)
    values, indices = R.pack_nm((q.to(torch.int16) + 1) * mask.to(torch.int16), 2, 4)
    layer = {
        "kept": R4.pack_codes((values - 1).to(torch.uint8), 4),
        "nm": (indices, 2, 4),
        "qweight": R4.pack_codes(q, 4),
        "scales": torch.rand(out_features, groups, generator=g) / 50 + 1e-3,
        "zeros": torch.randint(0, 16, (out_features, groups), dtype=torch.uint8, generator=g),
        "fp32": W,
        "bf16": W.bfloat16(),
        "in": in_features,
        "group_size": group_size,
    }
    # what an Int4Linear holds where the kernels are built: the tiles and the grid's tiled copy
    layer["tiles"] = int4_tiles.tile(layer["qweight"])
    layer["grid16"] = int4_tiles.tile_grid(layer["scales"], layer["zeros"])
    # and the 2:4 codes in int4_tiles24's layout (what a PackedNMInt4Linear holds on a CPU
    # with AVX2 and not AVX-512; timed here on any host)
    layer["tiles24"], layer["patterns24"] = int4_tiles24.tile(layer["kept"], indices, in_features)
    return layer


def fns() -> dict[str, Callable[[dict, torch.Tensor], Any]]:
    """One layer's computation for each implementation (2:4 + int4: the same codes, half of
    them pruned)."""

    def int4(layer, x):
        return int4_ops.linear(
            x, layer["tiles"], layer["scales"], layer["zeros"], bits=4,
            group_size=layer["group_size"], in_features=layer["in"], tiled=True,
            grid16=layer["grid16"],
        )  # fmt: skip

    def int4_rows(layer, x):
        return int4_ops.linear(
            x, layer["qweight"], layer["scales"], layer["zeros"], bits=4,
            group_size=layer["group_size"], in_features=layer["in"],
        )  # fmt: skip

    def int4_prefill(layer, x):
        return int4_ops.prefill(
            x, layer["qweight"], layer["scales"], layer["zeros"], 4, layer["group_size"],
            layer["in"],
        )  # fmt: skip

    def int4_24(layer, x):
        return int4_ops.linear(
            x, layer["kept"], layer["scales"], layer["zeros"], bits=4,
            group_size=layer["group_size"], in_features=layer["in"], nm=layer["nm"],
        )  # fmt: skip

    def int4_24_tiled(layer, x):
        return int4_ops.linear(
            x, layer["tiles24"], layer["scales"], layer["zeros"], bits=4,
            group_size=layer["group_size"], in_features=layer["in"],
            nm=(layer["patterns24"], 2, 4), tiled=True, grid16=layer["grid16"],
        )  # fmt: skip

    return {
        "dense fp32": lambda layer, x: F.linear(x, layer["fp32"]),
        "dense bf16": lambda layer, x: F.linear(x.bfloat16(), layer["bf16"]),
        "int4 fp32": int4,
        "int4 bf16": lambda layer, x: int4(layer, x.bfloat16()),
        "int4 bf16 rows": lambda layer, x: int4_rows(layer, x.bfloat16()),
        "int4 bf16 prefill path": lambda layer, x: int4_prefill(layer, x.bfloat16()),
        "2:4 + int4 bf16 rows": lambda layer, x: int4_24(layer, x.bfloat16()),
        "2:4 + int4 bf16 tiled": lambda layer, x: int4_24_tiled(layer, x.bfloat16()),
    }


def interleaved(calls: dict[str, Callable[[], Any]], rounds: int) -> dict[str, dict[str, float]]:
    """Median and least milliseconds of each call, all timed in each round (one warm-up
    round): on a CPU shared with other processes the least is the undisturbed time."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for round_ in range(rounds + 1):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            if round_:
                times[name].append((time.perf_counter() - start) * 1e3)
    return {
        name: {"median": round(statistics.median(values), 4), "min": round(min(values), 4)}
        for name, values in times.items()
    }


def shape_rows(rounds: int, g: torch.Generator) -> list[dict]:
    rows = []
    for out_features, in_features, group_size in SHAPES:
        copies = max(2, -(-COLD_BYTES // (4 * out_features * in_features)))
        built = [int4_layer(out_features, in_features, group_size, g) for _ in range(copies)]
        row = {"out": out_features, "in": in_features, "group_size": group_size, "copies": copies}
        for tokens, key, reps in ((1, "decode_ms", rounds), (PREFILL_TOKENS, "prefill_ms", 5)):
            x = torch.randn(tokens, in_features, generator=g)
            state = {"i": 0}

            def one(f, x=x, state=state, built=built):
                state["i"] = (state["i"] + 1) % len(built)
                return f(built[state["i"]], x)

            row[key] = interleaved({n: (lambda f=f: one(f)) for n, f in fns().items()}, reps)
        rows.append(row)
        del built
    return rows


def model_rows(rounds: int, g: torch.Generator) -> list[dict]:
    built = [int4_layer(o, i, 64, g) for o, i in SMOL * LAYERS]
    rows = []
    for tokens in MODEL_TOKENS:
        x = {n: torch.randn(tokens, n, generator=g) for n in (HIDDEN, INTERMEDIATE)}
        calls = {
            name: (lambda f=f, x=x: [f(layer, x[layer["in"]]) for layer in built])
            for name, f in fns().items()
        }
        rows.append({"tokens": tokens, "ms": interleaved(calls, max(3, rounds // 20))})
    return rows


def error_rows(g: torch.Generator) -> list[dict]:
    """Max |decode - float| / max |float| over 16 tokens, with and without an outlier."""
    rows = []
    for out_features, in_features, group_size in SHAPES[:3]:
        layer = int4_layer(out_features, in_features, group_size, g)
        W = R4.dequantize(layer["qweight"], layer["scales"], layer["zeros"], 4, group_size,
                          in_features)  # fmt: skip
        for outlier in (False, True):
            x = torch.randn(16, in_features, generator=g)
            if outlier:
                x[:, 5] = 100.0
            want = F.linear(x, W)
            got = int4_ops.decode(x, layer["qweight"], layer["scales"], layer["zeros"], 4,
                                  group_size, in_features)  # fmt: skip
            xg = x.view(16, -1, group_size)
            s8 = (xg.abs().amax(-1, keepdim=True) / 127).clamp_min(1e-12)
            x8 = (torch.round(xg / s8).clamp(-128, 127) * s8).view(16, in_features)
            bf = F.linear(x.bfloat16().float(), W)
            scale = float(want.abs().max())
            rows.append({
                "out": out_features, "in": in_features, "outlier": outlier,
                "int16 activations (the kernel)": float((got - want).abs().max()) / scale,
                "int8 activations per group": float((F.linear(x8, W) - want).abs().max()) / scale,
                "bf16-rounded activations": float((bf - want).abs().max()) / scale,
            })  # fmt: skip
    return rows


@torch.inference_mode()
def measure(args: argparse.Namespace, _names: list[str], _previous: dict) -> Iterator[dict]:
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    yield {
        "threads": args.threads,
        "rounds": args.rounds,
        "loadavg_before": os.getloadavg(),
        "kernel_vector_loops": VECTOR_LOOPS[int4_ops.cpu_kernels.library().lmc_int4_vector()],
        "error": error_rows(g),
        "shapes": shape_rows(args.rounds, g),
        "model": model_rows(args.rounds, g),
        "loadavg_after": os.getloadavg(),
    }


def _cells(ms: dict, names: list[str], scale: float, digits: int) -> str:
    return " | ".join(
        f"{ms[n]['median'] * scale:.{digits}f} ({ms[n]['min'] * scale:.{digits}f})" for n in names
    )


def _ratio(ms: dict, key: str) -> str:
    """The faster dense row's time over int4 bf16's, for medians and (least times)."""
    best = min(ms["dense fp32"][key], ms["dense bf16"][key])
    return f"{best / ms['int4 bf16'][key]:.2f}"


def _loops(record: dict) -> str:
    """The vector loops of a record (older records say only whether there were any)."""
    loops = record["kernel_vector_loops"]
    return {True: "AVX-512", False: "none"}.get(loops, loops) if isinstance(loops, bool) else loops


def render(record: dict[str, Any]) -> str:
    host = record["machine"]
    names = list(record["shapes"][0]["decode_ms"])
    lines = [
        f"Host: {host.get('cpu_model')} ({', '.join(host.get('isa') or [])}), "
        f"{record['threads']} threads, torch {host.get('torch')}; load average "
        f"{record['loadavg_before'][0]:.1f} before, {record['loadavg_after'][0]:.1f} after "
        f"(other processes shared the CPUs). Vector int4 loops: {_loops(record)}.",
        "",
        "Batch-1 decode per layer shape (weights cycled over copies: 256 MiB of fp32), "
        f"median (least) of {record['rounds']} interleaved rounds, µs; × best dense = the faster "
        "dense row's time over int4 bf16's, medians (least times):",
        "",
        "| out × in (group) | " + " | ".join(names) + " | int4 bf16 × best dense | "
        f"prefill {PREFILL_TOKENS} tok: dense bf16 / int4 bf16, median least |",
        "|---" * (len(names) + 3) + "|",
    ]
    for row in record["shapes"]:
        ms, pre = row["decode_ms"], row["prefill_ms"]
        prefill = " ".join(
            f"{pre['dense bf16'][k] / pre['int4 bf16'][k]:.2f}" for k in ("median", "min")
        )
        lines.append(
            f"| {row['out']} × {row['in']} (g{row['group_size']}) | {_cells(ms, names, 1e3, 1)} "
            f"| {_ratio(ms, 'median')} ({_ratio(ms, 'min')}) | {prefill} |"
        )
    lines += ["", "All 210 SmolLM2-135M decoder linears, one pass, ms:", ""]
    lines += ["| tokens | " + " | ".join(names) + " | int4 bf16 × best dense |"]
    lines += ["|---" * (len(names) + 2) + "|"]
    for row in record["model"]:
        ms = row["ms"]
        lines.append(
            f"| {row['tokens']} | {_cells(ms, names, 1, 2)} | {_ratio(ms, 'median')} "
            f"({_ratio(ms, 'min')}) |"
        )
    kinds = [k for k in record["error"][0] if k not in ("out", "in", "outlier")]
    lines += ["", "Decode error: max |y - y_float| / max |y_float| over 16 tokens, fp32:", ""]
    lines += ["| out × in | outlier (100) | " + " | ".join(kinds) + " |"]
    lines += ["|---" * (len(kinds) + 2) + "|"]
    for row in record["error"]:
        cells = " | ".join(f"{row[k]:.1e}" for k in kinds)
        lines.append(f"| {row['out']} × {row['in']} | {row['outlier']} | {cells} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    add_harness_args(parser, work=False)
    args = parser.parse_args(argv)
    return run_table(Table(NAME, render, measure), args, parser)


if __name__ == "__main__":
    sys.exit(main())
