"""Forward + backward of the vocabulary-chunked training losses at SmolLM2-135M's head shape:
the gradients computed in the forward (``compressor/model/head_grad.py``, what training runs
now) against each chunk checkpointed and recomputed in the backward (what it ran before).

    python -m benchmarks.head_loss_speed        # -> benchmarks/results/head_loss_speed.{json,md}

One window of 512 positions, hidden 576, a tied head of 49,152 tokens (frozen, as in every
training lmcompress runs: only the gradient for the hidden states is wanted; random values:
speed does not depend on them), the default chunk (341 positions). Three losses, as the
training paths use them: ``distill`` (the KL, the NLL logged without a gradient: GPTQ's
distilled scales, structured and low-rank distillation), ``lm`` (the NLL alone: MaskLLM and
subnet end to end), ``lm + distill`` (both with gradients). The two implementations alternate
in every round; median and least of the rounds, seconds; peak live bytes of torch's CPU
allocator over one call of each, from the profiler.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

import lmcompress.compressor.model.loss as loss
from benchmarks.allocator import peak_allocated_bytes
from benchmarks.harness import Table, add_harness_args, run_table
from benchmarks.render import markdown_table

NAME = "head_loss_speed"
POSITIONS, HIDDEN, VOCAB = 512, 576, 49_152
LOSSES = ("distill", "lm", "lm + distill")


def _checkpointed_chunk(*args):
    """A chunk as the losses ran before ``head_grad``: checkpointed, recomputed in backward
    (``args``: :func:`loss._fused_chunk`'s, the last one ``nll_grad``)."""
    return checkpoint(loss._chunk_losses, *args[:-1], use_reentrant=False)


def _step(kind: str, chunk_fn, inputs: dict[str, torch.Tensor]):
    """One forward + backward of ``kind``'s loss with ``chunk_fn`` as the chunk computation."""

    def run() -> None:
        hidden = inputs["hidden"].detach().requires_grad_(True)
        head = loss.Head(inputs["weight"], None, None, None)
        teacher = None if kind == "lm" else inputs["teacher"]
        targets = None if kind == "distill" else inputs["targets"]
        saved = loss._fused_chunk
        loss._fused_chunk = chunk_fn
        try:
            nll, kl = loss._run_chunks(
                head, hidden, targets, teacher, head.detached(),
                loss.default_chunk_tokens(VOCAB), loss.IGNORE_INDEX, kind != "distill",
            )  # fmt: skip
        finally:
            loss._fused_chunk = saved
        total = kl if kind == "distill" else nll + kl if kind == "lm + distill" else nll
        total.backward()

    return run


def measure(args: argparse.Namespace, _names: list[str], _previous: dict) -> Iterator[dict]:
    rounds = args.rounds
    g = torch.Generator().manual_seed(0)
    inputs = {
        "hidden": torch.randn(POSITIONS, HIDDEN, generator=g),
        "teacher": torch.randn(POSITIONS, HIDDEN, generator=g),
        "weight": 0.05 * torch.randn(VOCAB, HIDDEN, generator=g),
        "targets": torch.randint(0, VOCAB, (POSITIONS,), generator=g),
    }
    ways = {"fused": loss._fused_chunk, "checkpointed": _checkpointed_chunk}
    rows = []
    for kind in LOSSES:
        steps = {way: _step(kind, fn, inputs) for way, fn in ways.items()}
        for run in steps.values():
            run()  # warm-up
        times: dict[str, list[float]] = {way: [] for way in ways}
        for _ in range(rounds):
            for way, run in steps.items():
                start = time.perf_counter()
                run()
                times[way].append(time.perf_counter() - start)
        row: dict[str, Any] = {"loss": kind}
        for way in ways:
            row[way] = {
                "median_s": statistics.median(times[way]),
                "least_s": min(times[way]),
                "peak_mib": peak_allocated_bytes(steps[way]) / 2**20,
            }
        rows.append(row)
    yield {"rounds": rounds, "threads": torch.get_num_threads(), "rows": rows}


def render(payload: dict[str, Any]) -> str:
    host = payload["machine"]
    head = (
        f"Host: {host['cpu_model']} ({', '.join(host['isa'] or [])}), "
        f"{payload['threads']} threads, torch {host['torch']}. One window of {POSITIONS} "
        f"positions through a {VOCAB} x {HIDDEN} head, forward + backward, "
        f"{payload['rounds']} interleaved rounds; seconds, median (least); peak MiB: torch's "
        "CPU allocator over one call.\n\n"
    )
    table = []
    for row in payload["rows"]:
        fused, old = row["fused"], row["checkpointed"]
        table.append([
            row["loss"],
            f"{old['median_s']:.3f} ({old['least_s']:.3f})",
            f"{fused['median_s']:.3f} ({fused['least_s']:.3f})",
            f"{fused['median_s'] / old['median_s']:.2f}",
            f"{old['peak_mib']:.0f}",
            f"{fused['peak_mib']:.0f}",
        ])  # fmt: skip
    header = [
        "loss", "checkpointed s", "gradients in the forward s", "time × checkpointed",
        "checkpointed peak MiB", "in the forward peak MiB",
    ]  # fmt: skip
    return head + markdown_table(header, table) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_harness_args(parser, work=False)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args(argv)
    return run_table(Table(NAME, render, measure), args, parser)


if __name__ == "__main__":
    sys.exit(main())
