"""The compressed layers' own speed on SmolLM2-135M's 210 decoder-linear shapes, without the
model around them: what sets the CPU kernels' token limits, and whether low rank's ranks
should be rounded for the CPU's matmul.

    python -m benchmarks.layer_speed               # -> benchmarks/results/layer_speed.{json,md}
    python -m benchmarks.layer_speed --render-only

Random weights of every decoder linear's shape (30 layers × q, k, v, o, gate, up, down: more
bytes than the CPU's caches, so they stream from memory as in a model), one pass over all 210
per timing, the implementations interleaved in each round, median of the rounds:

- ``decode``: milliseconds for 1–16 tokens through all 210 layers: dense bf16 and fp32
  ``F.linear``; int8 W8A8 as torch computes it (quantize, ``_int_mm``, rescale) and as the
  fused kernel does, and 2:4 + int8 (packed codes) through it; low rank at ratio 0.8 in bf16
  as two torch linears and as the kernel; packed 2:4 in bf16 through its kernel and unpacked
  then ``F.linear``, and on :mod:`~lmcompress.kernels.nm24_tiles`' tiles through the tiled
  kernel.
- ``ranks``: low rank at ratio 0.8 in bf16, prefill (4 × 256 tokens), at each layer's rank and
  rounded down to multiples of 16, 32 and 64, against dense bf16.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.harness import Table, add_harness_args, run_table
from lmcompress.compressor.formats import quant
from lmcompress.compressor.formats.int8 import quantize_activations
from lmcompress.compressor.sparsity import nm_mask
from lmcompress.kernels import cpu_kernels, int8_ops, nm24_tiles, ops
from lmcompress.kernels import reference as R

NAME = "layer_speed"
HIDDEN, INTERMEDIATE, KV, LAYERS = 576, 1536, 192, 30  # SmolLM2-135M
SHAPES = [
    (HIDDEN, HIDDEN),
    (KV, HIDDEN),
    (KV, HIDDEN),
    (HIDDEN, HIDDEN),
    (INTERMEDIATE, HIDDEN),
    (INTERMEDIATE, HIDDEN),
    (HIDDEN, INTERMEDIATE),
] * LAYERS  # fmt: skip  (out, in)
TOKENS = (1, 2, 4, 8, 12, 16)
RATIO = 0.8
PREFILL_TOKENS = 4 * 256
MULTIPLES = (1, 16, 32, 64)


def rank_at(out_features: int, in_features: int, multiple: int = 1) -> int:
    """The rank that keeps ``RATIO`` of the parameters, rounded down to ``multiple``."""
    rank = int(RATIO * out_features * in_features / (out_features + in_features))
    return max(multiple, rank // multiple * multiple)


def layers(seed: int = 0) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(seed)
    built = []
    for out_features, in_features in SHAPES:
        W = torch.randn(out_features, in_features, generator=g) / in_features**0.5
        codes, scale = quant.int8_weight(W)
        rank = rank_at(out_features, in_features)
        sparse = W * nm_mask(W.abs(), 2, 4)
        values, indices = R.pack_nm(sparse.bfloat16(), 2, 4)
        sparse_codes, sparse_scale = quant.int8_weight(sparse)
        codes24, indices24 = R.pack_nm(sparse_codes, 2, 4)
        built.append({
            "bf16": W.bfloat16(), "fp32": W, "codes": codes, "scale": scale,
            "A": W[:rank].bfloat16(), "B": W[:, :rank].contiguous().bfloat16(),
            "values": values, "indices": indices, "in": in_features,
            "tiles24": nm24_tiles.tile(values, indices),
            "codes24": codes24, "indices24": indices24, "scale24": sparse_scale,
        })  # fmt: skip
    return built


def decode_fns() -> dict[str, Callable[[dict, torch.Tensor], Any]]:
    """One layer's computation for each implementation, given ``x[in]`` inputs."""

    def int8_torch(layer, x):
        x_q, x_scale = quantize_activations(x, None)
        return int8_ops.linear(x_q, x_scale, layer["codes"], layer["scale"], None, x.dtype)

    def nm_unpacked(layer, x):
        W = ops.unpack_nm(layer["values"], layer["indices"], 2, 4, layer["in"])
        return F.linear(x, W)

    return {
        "dense bf16": lambda layer, x: F.linear(x.bfloat16(), layer["bf16"]),
        "dense fp32": lambda layer, x: F.linear(x, layer["fp32"]),
        "int8 torch": int8_torch,
        "int8 kernel": lambda layer, x: cpu_kernels.int8_linear(
            x, layer["scale"], None, None, layer["codes"]
        ),
        "2:4 + int8 kernel": lambda layer, x: cpu_kernels.int8_linear(
            x, layer["scale24"], None, None, layer["codes24"], layer["indices24"], 2, 4
        ),
        "low rank bf16 torch": lambda layer, x: F.linear(
            F.linear(x.bfloat16(), layer["A"]), layer["B"]
        ),
        "low rank bf16 kernel": lambda layer, x: cpu_kernels.lowrank(
            x.bfloat16(), layer["A"], layer["B"]
        ),
        "2:4 bf16 kernel": lambda layer, x: cpu_kernels.matmul(
            x.bfloat16(), layer["values"], layer["indices"], 2, 4, 2
        ),
        "2:4 bf16 unpack + linear": lambda layer, x: nm_unpacked(layer, x.bfloat16()),
        "2:4 bf16 tiled kernel": lambda layer, x: nm24_tiles.linear(
            x.bfloat16(), *layer["tiles24"]
        ),
    }


def interleaved(fns: dict[str, Callable[[], Any]], rounds: int) -> dict[str, float]:
    """Median milliseconds of each function, all timed in each round (one warm-up round)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for round_ in range(rounds + 1):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            if round_:
                times[name].append((time.perf_counter() - start) * 1e3)
    return {name: round(statistics.median(values), 3) for name, values in times.items()}


@torch.inference_mode()
def measure(args: argparse.Namespace, _names: list[str], _previous: dict) -> Iterator[dict]:
    torch.set_num_threads(args.threads)
    built = layers()
    g = torch.Generator().manual_seed(1)
    decode = []
    for tokens in TOKENS:
        x = {n: torch.randn(tokens, n, generator=g) for n in (HIDDEN, INTERMEDIATE)}
        fns = {
            name: (lambda f=f, x=x: [f(layer, x[layer["in"]]) for layer in built])
            for name, f in decode_fns().items()
        }
        decode.append({"tokens": tokens, "ms": interleaved(fns, args.rounds)})
    x = {n: torch.randn(PREFILL_TOKENS, n, generator=g).bfloat16() for n in (HIDDEN, INTERMEDIATE)}
    fns = {"dense bf16": lambda: [F.linear(x[layer["in"]], layer["bf16"]) for layer in built]}
    ranks = {}
    for multiple in MULTIPLES:
        factors = []
        for (out_features, in_features), layer in zip(SHAPES, built, strict=True):
            rank = rank_at(out_features, in_features, multiple)
            factors.append((layer["in"], layer["fp32"][:rank].bfloat16(),
                            layer["fp32"][:, :rank].contiguous().bfloat16()))  # fmt: skip
        ranks[multiple] = sum(a.numel() + b.numel() for _, a, b in factors)
        fns[f"low rank, ranks × {multiple}"] = lambda factors=factors: [
            F.linear(F.linear(x[n], A), B) for n, A, B in factors
        ]
    prefill = interleaved(fns, args.rounds)
    yield {
        "shapes": "SmolLM2-135M decoder linears (210)",
        "rounds": args.rounds,
        "threads": args.threads,
        "decode": decode,
        "prefill_tokens": PREFILL_TOKENS,
        "prefill_ms": prefill,
        "dense_params": sum(o * i for o, i in SHAPES),
        "low_rank_params": {str(k): v for k, v in ranks.items()},
    }


def render(record: dict[str, Any]) -> str:
    host = record["machine"]
    names = list(record["decode"][0]["ms"])
    lines = [
        f"Host: {host.get('cpu_model')} ({', '.join(host.get('isa') or [])}), "
        f"{record['threads']} threads, torch {host.get('torch')}.",
        "",
        f"All {record['shapes']}, random weights; median of {record['rounds']} interleaved "
        "rounds after a warm-up. Milliseconds for one pass over all 210 layers (lower is "
        "faster):",
        "",
        "| tokens | " + " | ".join(names) + " |",
        "|---" * (len(names) + 1) + "|",
    ]
    for row in record["decode"]:
        lines.append(
            f"| {row['tokens']} | " + " | ".join(f"{row['ms'][n]:.1f}" for n in names) + " |"
        )
    dense = record["prefill_ms"]["dense bf16"]
    lines += [
        "",
        f"Low rank at ratio {RATIO} in bf16, prefill ({record['prefill_tokens']} tokens), ranks "
        "rounded down to a multiple:",
        "",
        "| layers | parameters × dense | ms | × dense bf16 speed |",
        "|---|---|---|---|",
        f"| dense bf16 | 1.00 | {dense:.1f} | 1.00 |",
    ]
    for multiple, params in record["low_rank_params"].items():
        ms = record["prefill_ms"][f"low rank, ranks × {multiple}"]
        share = params / record["dense_params"]
        lines.append(
            f"| low rank, ranks × {multiple} | {share:.3f} | {ms:.1f} | {dense / ms:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    add_harness_args(parser, work=False)
    args = parser.parse_args(argv)
    return run_table(Table(NAME, render, measure), args, parser)


if __name__ == "__main__":
    sys.exit(main())
