"""Models larger than memory: SparseGPT 2:4 streamed block by block vs in memory, on a random
Llama whose fp32 weights are ≥ 2 GB, written as sharded safetensors.

    OMP_NUM_THREADS=1 python -m benchmarks.streaming        # ~15 min on 2 cores, ~30 GB of /tmp
    python -m benchmarks.streaming --render-only

Three processes (``benchmarks.runner``, each measured for wall time and peak RSS): this script
writes the checkpoint shard by shard (a block at a time: the generator never holds the model),
with SmolLM2's tokenizer so that the calibration text can be read; ``compress-model CKPT
--streaming`` compresses it (8 windows × 128 tokens of ``wiki-calib``, no evaluation); then the
same command without ``--streaming`` compresses it in memory, both at once (one thread
each). Every tensor of the two outputs
(the sharded dense copy, ``compressed.safetensors``) is then compared with ``torch.equal``,
key by key. The goal: peak RSS of the streamed run ≤ 0.35 × the checkpoint's weight bytes.
Writes ``benchmarks/results/streaming.{json,md}``; the temporary files are deleted.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.render import add_harness_args, markdown_table, render_files, write_results
from benchmarks.runner import CLI, PYTHON, Job, machine, run_job

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


def write_checkpoint(path: Path, seed: int = 0) -> int:
    """A random Llama of :data:`MODEL` in ``path``, one safetensors shard per block plus one
    for the rest, and its index; SmolLM2's tokenizer beside it. Returns the weight bytes."""
    import torch
    import transformers
    from safetensors.torch import save_file

    from lmcompress.compressor.model.loading import model_skeleton
    from lmcompress.compressor.util.cache import cache_dir

    config = transformers.LlamaConfig(**MODEL, bos_token_id=1, eos_token_id=2)
    skeleton = model_skeleton(config)
    shapes = {k: tuple(v.shape) for k, v in skeleton.state_dict().items()}
    groups: dict[str, list[str]] = {}
    for key in shapes:
        parts = key.split(".")
        group = parts[2] if key.startswith("model.layers.") else "rest"
        groups.setdefault(group, []).append(key)
    generator = torch.Generator().manual_seed(seed)
    weight_map, total = {}, 0
    for i, keys in enumerate(groups.values(), 1):
        name = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        tensors = {
            key: torch.ones(shapes[key])
            if key.endswith("norm.weight")
            else torch.randn(shapes[key], generator=generator) * 0.02
            for key in keys
        }
        save_file(tensors, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, name))
        total += sum(t.nbytes for t in tensors.values())
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(path)
    tokenizer = cache_dir() / "smollm2-135m"  # compress-model smollm2-135m caches it
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / file, path / file)
    return total


def compare_outputs(a: Path, b: Path) -> dict[str, Any]:
    """Every tensor of two output directories, key by key: counts and the keys that differ."""
    import torch
    from safetensors import safe_open

    def index(out: Path) -> dict[tuple[str, str], Path]:
        found = {}
        for file in sorted(out.glob("*.safetensors")):
            kind = "compressed" if file.name == "compressed.safetensors" else "dense"
            with safe_open(str(file), framework="pt") as f:
                found.update({(kind, key): file for key in f.keys()})  # noqa: SIM118
        return found

    left, right = index(a), index(b)
    differ = []
    for key in sorted(set(left) & set(right)):
        with (
            safe_open(str(left[key]), framework="pt") as f,
            safe_open(str(right[key]), framework="pt") as g,
        ):
            x, y = f.get_tensor(key[1]), g.get_tensor(key[1])
            if x.dtype != y.dtype or not torch.equal(x, y):
                differ.append("/".join(key))
    only = sorted("/".join(k) for k in set(left) ^ set(right))
    return {
        "tensors": len(set(left) | set(right)),
        "compressed_tensors": sum(kind == "compressed" for kind, _ in left),
        "differ": differ[:20],
        "only_in_one": only[:20],
        "equal": not differ and not only,
    }


def run_all(work: Path, keep: bool) -> dict[str, Any]:
    checkpoint, outputs = work / "checkpoint", work / "outputs"
    checkpoint.mkdir(parents=True)
    generate = Job(
        "generate checkpoint",
        (PYTHON, "-m", "benchmarks.streaming", "--child-generate", str(checkpoint)),
        env=THREADS,
    )
    run_job(generate, work)
    weight_bytes = json.loads((checkpoint / "model.safetensors.index.json").read_text())[
        "metadata"
    ]["total_size"]
    # The two paths side by side, one thread each (the machine has two cores): each process's
    # own peak RSS is measured; their wall times are those of two jobs sharing the machine.
    paths = {"streaming": ("--streaming",), "in memory": ()}
    jobs = []
    for name, extra in paths.items():
        out = outputs / name.replace(" ", "-")
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
    comparison = compare_outputs(outputs / "streaming", outputs / "in-memory")
    if not keep:
        shutil.rmtree(work)
    return {
        "settings": {"model": MODEL, "flags": list(FLAGS), "threads": 1},
        "machine": machine(),
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
    add_harness_args(parser, "(one job: ignored)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint and outputs")
    parser.add_argument("--child-generate", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if args.child_generate:
        print(json.dumps({"weight_bytes": write_checkpoint(args.child_generate)}))
        return 0
    if not args.render_only:
        work = args.work or Path(tempfile.mkdtemp(prefix="lmcompress-streaming-"))
        write_results(args.results_dir, NAME, run_all(work, args.keep), render)
    print(render_files(args.results_dir, NAME, render))
    return 0


if __name__ == "__main__":
    sys.exit(main())
