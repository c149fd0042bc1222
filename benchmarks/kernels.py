"""Speed of the packed 2:4 matmul kernel on one GPU, against dense cuBLAS and cuSPARSELt.

    python -m benchmarks.kernels                       # on a CUDA GPU: < 8 min on an H200
    python -m benchmarks.kernels --smoke               # CPU, Triton interpreter, a tmp dir
    python -m benchmarks.kernels --render-only         # redraw the md and PNG from the JSON

Nothing is downloaded: every weight is random. For each projection shape ``(out, in)`` of
SmolLM2-135M, Llama-2-7B and Llama-2-70B, and ``tokens`` = 1, 16, 128, 2048, 8192, with
``x (tokens, in)`` and a 2:4-sparse ``W`` (magnitude mask), three ways to compute ``x Wᵀ``:

- ``dense``: ``torch.nn.functional.linear`` on the dense (masked) fp16/bf16 weight (cuBLAS);
- ``ours``: :func:`lmcompress.kernels.nm_linear_triton.nm_linear_triton` on the packed weight
  (autotuned; the first call per shape tunes, untimed);
- ``cusparselt``: ``torch.sparse.to_sparse_semi_structured`` (cuSPARSELt, or CUTLASS), where this
  torch and GPU have it (its error is recorded otherwise).

Times are medians of ``triton.testing.do_bench``. TFLOP/s count the dense-equivalent
``2·tokens·out·in`` for every row (so they compare like for like); GB/s count the bytes each row
must move (``x``, its weight form: dense, packed at 56 %, or cuSPARSELt's, and ``y``). The
``max_rel_err`` column compares ours with the dense result (``|y - y_dense|max / |y_dense|max``).

End to end: greedy decode of a random TinyLlama-1.1B-shaped Llama in fp16 (64 prompt tokens,
128 new ones), the dense model against the same model after ``compress(model,
MagnitudeConfig())`` (2:4), ``save_compressed(dense_copy=False)`` and ``load_compressed(...,
runtime="packed", device="cuda")``: the path a user takes. Eager transformers decode at batch 1
is bound by kernel launches, not bytes, so this row shows the overhead as much as the kernel.

``--smoke`` runs the same code on tiny shapes with CPU tensors in Triton's interpreter (no GPU:
times are meaningless, correctness is checked) and a tiny Llama; ``tests/benchmarks`` runs it.
Writes ``kernels.{json,md}`` and ``kernels_curves.png`` under ``--results-dir`` (a smoke run: a
new temporary directory by default, never ``benchmarks/results``). The measurements are in
``kernels_sweep.py``, the table and figure in ``kernels_render.py``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch

from benchmarks.harness import RunFailed, Table, add_harness_args, run_table
from benchmarks.kernels_render import plot, render

NAME = "kernels"
SHAPES = {  # model: {projection: (out, in)}
    "SmolLM2-135M": {"q/o": (576, 576), "k/v": (192, 576), "gate/up": (1536, 576)}
    | {"down": (576, 1536)},
    "Llama-2-7B": {"q/k/v/o": (4096, 4096), "gate/up": (11008, 4096), "down": (4096, 11008)},
    "Llama-2-70B": {"q/o": (8192, 8192), "k/v": (1024, 8192), "gate/up": (28672, 8192)}
    | {"down": (8192, 28672)},
}
TOKENS = (1, 16, 128, 2048, 8192)
BF16_MODELS = ("Llama-2-7B",)  # bf16 on these only (time)
SMOKE_SHAPES = {"tiny": {"a": (24, 64), "b": (40, 96)}}
SMOKE_TOKENS = (1, 5, 33)
E2E = {  # TinyLlama-1.1B's shape, random weights
    "vocab_size": 32000,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 22,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
}
SMOKE_E2E = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
JOBS = [*SHAPES, *SMOKE_SHAPES, "e2e"]  # each model's shapes, and the end-to-end decode


def measure(args: argparse.Namespace, names: list[str], previous: dict) -> Iterator[dict]:
    """The sweep over the models picked (their rows replace theirs in ``previous``), written
    before the end-to-end decode; fails the run where the kernel disagrees with dense."""
    # the measuring code imports Triton (through the library): after check_device
    from benchmarks.kernels_sweep import end_to_end, gpu_info, kernel_sweep, timer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    start = time.monotonic()
    settings = {"smoke": args.smoke, "dtypes": args.dtypes, "budget_minutes": args.budget_minutes}
    payload: dict[str, Any] = {"settings": settings, "machine": gpu_info(device)}
    plan = {
        "shapes": SMOKE_SHAPES if args.smoke else SHAPES,
        "tokens": SMOKE_TOKENS if args.smoke else TOKENS,
        "dtypes": DTYPES,
        "bf16_models": BF16_MODELS,
    }
    deadline = start + 60 * args.budget_minutes
    rows = kernel_sweep(args, names, device, timer(device), deadline, plan)
    rerun = {(r["dtype"], r["model"]) for r in rows}
    kept = [r for r in previous.get("rows", []) if (r["dtype"], r["model"]) not in rerun]
    order = [*DTYPES], [*SHAPES, *SMOKE_SHAPES]  # the table's; a stable sort keeps the rest's
    payload["rows"] = sorted(
        kept + rows, key=lambda r: (order[0].index(r["dtype"]), order[1].index(r["model"]))
    )
    yield payload  # kill-safe before the e2e
    if not args.no_e2e and "e2e" in names:
        payload["end_to_end"] = end_to_end(args, device, SMOKE_E2E if args.smoke else E2E)
    elif "end_to_end" in previous:
        payload["end_to_end"] = previous["end_to_end"]
    payload["seconds"] = round(time.monotonic() - start, 1)
    yield payload
    errors = [r["max_rel_err"] for r in payload["rows"] if "skipped" not in r]
    bad = [e for e in errors if e is None or not e <= 1e-2]  # failed, NaN, or too far
    if bad:
        raise RunFailed(f"the kernel failed or disagrees with dense on {len(bad)} row(s)")


def check_device(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A GPU, or ``--smoke`` in Triton's interpreter (set before the kernel is imported)."""
    if torch.cuda.is_available():
        return
    if not args.smoke:
        parser.error("needs a CUDA GPU; --smoke runs tiny shapes in Triton's interpreter")
    # Read when @triton.jit runs, i.e. when the kernel module is first imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from lmcompress.kernels import nm_linear_triton  # triton: only once the flag is set

    if not nm_linear_triton.interpreted():
        parser.error("--smoke on CPU: the kernel module was imported without TRITON_INTERPRET=1")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, CPU interpreter")
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=None)
    parser.add_argument(
        "--budget-minutes", type=float, default=5.5, help="kernel sweep time limit (shapes left "
        "are recorded as skipped); the end-to-end decode comes after it"
    )  # fmt: skip
    parser.add_argument("--no-e2e", action="store_true", help="skip the end-to-end decode")
    add_harness_args(
        parser, "rerun these models' shapes (or the end-to-end decode: e2e)", work=False
    )
    args = parser.parse_args(argv)
    if not args.render_only:
        check_device(parser, args)
    args.dtypes = args.dtypes or (["fp16", "fp32"] if args.smoke else ["fp16", "bf16"])
    return run_table(Table(NAME, render, measure, JOBS, plot), args, parser)


if __name__ == "__main__":
    sys.exit(main())
