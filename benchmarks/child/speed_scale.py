"""The random-weight checkpoints of ``speed_scale``, in their own process.

    python -m benchmarks.child.speed_scale OUT MODEL [BLOCKS]

A Llama of ``MODEL``'s shape (``benchmarks.speed_scale.SHAPES``; ``BLOCKS`` decoder blocks
instead of its own), with SmolLM2's vocabulary and tokenizer, weights normal with std 0.02
(norms 1), saved in bf16. Speed does not depend on the values.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.speed_scale import SHAPES
from lmcompress.compressor.model.loading import load_model


def build(out: Path, model: str, blocks: int | None = None) -> None:
    _, tokenizer = load_model("smollm2-135m")
    shape = dict(SHAPES[model])
    if blocks:
        shape["num_hidden_layers"] = blocks
    config = LlamaConfig(vocab_size=len(tokenizer), rope_theta=500000.0, **shape)
    config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    torch.manual_seed(0)
    with torch.device("meta"):
        net = LlamaForCausalLM(config)
    net = net.to_empty(device="cpu").to(torch.bfloat16)
    with torch.no_grad():
        for p in net.parameters():
            p.normal_(0.0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    net.tie_weights()  # to_empty untied the head from the embedding (where the config ties)
    net.save_pretrained(out)
    tokenizer.save_pretrained(out)


if __name__ == "__main__":
    build(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else None)
