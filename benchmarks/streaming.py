"""Models larger than memory: SparseGPT 2:4 streamed block by block vs in memory, on a random
Llama whose fp32 weights are ≥ 2 GB, written as sharded safetensors.

    OMP_NUM_THREADS=1 python -m benchmarks.streaming        # ~15 min on 2 cores, ~30 GB of /tmp
    python -m benchmarks.streaming --render-only

Four processes (``benchmarks.runner``, each measured for wall time and peak RSS):
``benchmarks.child.streaming generate`` writes the checkpoint shard by shard (a block at a
time: the generator never holds the model), with SmolLM2's tokenizer so that the calibration
text can be read; ``compress-model CKPT --streaming`` compresses it (8 windows × 128 tokens of
``wiki-calib``, no evaluation) while the same command without ``--streaming`` compresses it in
memory, both at once (one thread each); then ``benchmarks.child.streaming compare`` compares
every tensor of the two outputs (the sharded dense copy, ``compressed.safetensors``) with
``torch.equal``, key by key. The goal: peak RSS of the streamed run ≤ 0.35 × the checkpoint's
weight bytes. Writes ``benchmarks/results/streaming.{json,md}``; the checkpoint and the outputs
are deleted (``--keep`` keeps them), the job logs stay in ``--work``.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from benchmarks.harness import Table, add_harness_args, run_table
from benchmarks.render import markdown_table
from benchmarks.runner import CLI, PYTHON, STDOUT, Job, run_job, slug

log = logging.getLogger(__name__)

NAME = "streaming"
GOAL = 0.35  # peak RSS / weight bytes
MODEL = {  # Llama-2-style widths, many blocks: one block is ~3 % of the weights
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "vocab_size": 49152,  # SmolLM2's tokenizer
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}
FLAGS = ("--method", "sparsegpt", "--sparsity", "2:4", "--nsamples", "8", "--seq-len", "128")
THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def run_all(args: argparse.Namespace, _names: list[str], _previous: dict) -> Iterator[dict]:
    """Generate the checkpoint, compress it both ways side by side, compare the outputs."""
    work, child = args.work, (PYTHON, "-m", "benchmarks.child.streaming")
    checkpoint, outputs = work / "checkpoint", work / "outputs"
    checkpoint.mkdir(parents=True)
    generate = Job("generate checkpoint", (*child, "generate", str(checkpoint)), STDOUT, THREADS)
    weight_bytes = run_job(generate, work).result["weight_bytes"]
    # The two paths side by side, one thread each (the machine has two cores): each process's
    # own peak RSS is measured; their wall times are those of two jobs sharing the machine.
    paths = {"streaming": ("--streaming",), "in memory": ()}
    jobs = []
    for name, extra in paths.items():
        out = outputs / slug(name)
        command = (*CLI, str(checkpoint), *FLAGS, "--eval", *extra, "-o", str(out), "-q")
        jobs.append(Job(name, command, out / "compression.json", env=THREADS))
    with ThreadPoolExecutor(len(jobs)) as pool:
        runs = list(pool.map(lambda job: run_job(job, work), jobs))
    rows = []
    for (name, extra), run in zip(paths.items(), runs, strict=True):
        rows.append(
            {
                "name": name,
                "command": "compress-model CKPT " + " ".join((*FLAGS, "--eval", *extra)),
                "wall_seconds": run.wall_seconds,
                "peak_rss_mb": run.peak_rss_mb,
                "rss_over_weights": run.peak_rss_mb * 2**20 / weight_bytes,
                "summary": run.result["report"]["summary"],
            }
        )
        log.info("%s: %.0f s, peak RSS %.0f MiB", name, run.wall_seconds, run.peak_rss_mb)
    compare = (*child, "compare", str(outputs / "streaming"), str(outputs / "in-memory"))
    comparison = run_job(Job("compare outputs", compare, STDOUT), work).result
    if not args.keep:  # ~30 GB; the job logs stay
        shutil.rmtree(checkpoint)
        shutil.rmtree(outputs)
    yield {
        "settings": {"model": MODEL, "flags": list(FLAGS), "threads": 1},
        "weight_bytes": weight_bytes,
        "goal_rss_over_weights": GOAL,
        "results": rows,
        "equality": comparison,
    }


def render(payload: dict[str, Any]) -> str:
    gb = payload["weight_bytes"] / 1e9
    model = payload["settings"]["model"]
    eq = payload["equality"]
    rows = [
        [
            r["name"],
            f"{r['wall_seconds']:.0f}",
            f"{r['peak_rss_mb']:.0f}",
            f"{r['rss_over_weights']:.3f}",
        ]
        for r in payload["results"]
    ]
    verdict = "bit-identical" if eq["equal"] else f"DIFFERENT ({eq['differ'] or eq['only_in_one']})"
    return (
        f"# Models larger than memory\n\n"
        f"Random Llama, {model['num_hidden_layers']} blocks of hidden {model['hidden_size']} / "
        f"MLP {model['intermediate_size']}, vocabulary {model['vocab_size']} (untied head): "
        f"{gb:.2f} GB of fp32 weights in {model['num_hidden_layers'] + 1} safetensors shards. "
        f"`compress-model CKPT {' '.join(payload['settings']['flags'])} --eval` (wiki-calib, "
        "no evaluation), with and without `--streaming`, side by side, one thread each. "
        f"Goal: streamed peak RSS ≤ {payload['goal_rss_over_weights']} × the weight bytes.\n\n"
        + markdown_table(["path", "wall s", "peak RSS MiB", "peak RSS / weight bytes"], rows)
        + f"\n\nOutputs: {eq['tensors']} tensors ({eq['compressed_tensors']} in "
        f"`compressed.safetensors`), {verdict} (`torch.equal`, key by key).\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_harness_args(parser)
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint and outputs")
    return run_table(Table(NAME, render, run_all), parser.parse_args(argv), parser)


if __name__ == "__main__":
    sys.exit(main())
