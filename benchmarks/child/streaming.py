"""The jobs of ``benchmarks.streaming`` that are not ``compress-model``, each in its own process.

    python -m benchmarks.child.streaming generate CKPT   # write the random checkpoint
    python -m benchmarks.child.streaming compare A B     # every tensor of two outputs

Each prints its result as JSON.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

from benchmarks.streaming import MODEL
from lmcompress.cache import cache_dir
from lmcompress.compressor.model.loading import model_skeleton


def write_checkpoint(path: Path, seed: int = 0) -> int:
    """A random Llama of :data:`MODEL` in ``path``, one safetensors shard per block plus one
    for the rest, and its index; SmolLM2's tokenizer beside it. Returns the weight bytes."""
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


if __name__ == "__main__":
    command, *paths = sys.argv[1:]
    if command == "generate":
        print(json.dumps({"weight_bytes": write_checkpoint(Path(paths[0]))}))
    else:
        print(json.dumps(compare_outputs(Path(paths[0]), Path(paths[1]))))
