"""The tiny checkpoints of the ``memory_estimate`` table (``tiny:FAMILY``), in their own process.

    python -m benchmarks.child.memory_estimate DIR   # DIR/FAMILY for every family

The seven families of ``tests/conftest.py`` at its shapes (hidden 32, MLP 64, two blocks), with
SmolLM2's vocabulary and tokenizer so that the bundled corpora calibrate and score them. Prints
as JSON the families, SmolLM2's cached checkpoint directory (what ``--streaming`` reads) and
the factor the estimates aim for (``ESTIMATE_FACTOR``).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
import transformers

from lmcompress.cache import cache_dir
from lmcompress.compressor.model.budget import ESTIMATE_FACTOR

SHAPES = {  # names as LlamaConfig spells them; GPT-2's config maps them to its own
    "vocab_size": 49152,  # SmolLM2's tokenizer
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
FAMILIES = {  # what a family names otherwise, or would default to too large
    "llama": {"tie_word_embeddings": True},
    "mistral": {},
    "qwen2": {},
    "gemma3_text": {"head_dim": 8, "sliding_window": 16},
    "gpt2": {},
    "opt": {"ffn_dim": 64, "word_embed_proj_dim": 32},
    "gpt_neox": {},
}


def write_tiny(root: Path, seed: int = 0) -> list[str]:
    """A random tiny checkpoint of every family in ``root/FAMILY``."""
    tokenizer = cache_dir() / "smollm2-135m"  # compress-model smollm2-135m caches it
    for family, extra in FAMILIES.items():
        config = transformers.AutoConfig.for_model(family, **SHAPES, **extra)
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.save_pretrained(root / family)
        for file in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer / file, root / family / file)
    return list(FAMILIES)


if __name__ == "__main__":
    root = Path(sys.argv[1])
    smollm2 = str(cache_dir() / "smollm2-135m")
    print(json.dumps({"families": write_tiny(root), "smollm2": smollm2, "factor": ESTIMATE_FACTOR}))
