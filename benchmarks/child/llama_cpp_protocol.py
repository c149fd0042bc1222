"""The lmcompress side of ``benchmarks.gguf_llama_cpp``, one process per call (torch loads here,
not in the driver). Each command prints one JSON line:

    python -m benchmarks.child.llama_cpp_protocol text CORPUS PATH       # the corpus as a file
    python -m benchmarks.child.llama_cpp_protocol alias                  # the packaged GGUF's path
    python -m benchmarks.child.llama_cpp_protocol ppl MODEL PATH CTX CHUNKS  # and the file's ids

``MODEL`` is ``dense`` (``load_model("smollm2-135m")``: the packaged GGUF dequantized) or an
output directory (``load_compressed(..., runtime="packed")``). ``ppl`` is llama.cpp's
``llama-perplexity`` protocol (``tools/perplexity/perplexity.cpp``): the file tokenized whole
(SmolLM2's vocabulary adds no BOS), cut into chunks of ``CTX`` tokens from its start, each chunk
one forward, the tokens of its second half scored (``CTX/2 - 1`` of them: logits at positions
``CTX/2 .. CTX-2`` predicting the next token), the perplexity over all scored tokens.
"""

from __future__ import annotations

import json
import math
import sys

import torch

from lmcompress import load_compressed, load_model
from lmcompress.compressor.model.checkpoint import alias_gguf
from lmcompress.evaluation.corpora import load_text


def _model(which: str):
    if which == "dense":
        return load_model("smollm2-135m")
    model, tokenizer, _ = load_compressed(which, runtime="packed")
    return model, tokenizer


def _ids(tokenizer, path: str) -> torch.Tensor:
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    return torch.tensor(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])


@torch.inference_mode()
def perplexity(model, ids: torch.Tensor, ctx: int, chunks: int) -> dict:
    first = ctx // 2
    nll, count = 0.0, 0
    positions = torch.arange(first, ctx - 1)
    for chunk in range(min(chunks, ids.numel() // ctx)):
        window = ids[chunk * ctx : (chunk + 1) * ctx][None]  # (1, ctx)
        logp = torch.log_softmax(model(window).logits[0].double(), dim=-1)  # (ctx, vocab)
        nll -= float(logp[positions, window[0, positions + 1]].sum())
        count += positions.numel()
    return {"ppl": math.exp(nll / count), "scored": count, "ids": ids.tolist()}


def main(argv: list[str]) -> dict:
    command, *rest = argv
    if command == "text":
        corpus, path = rest
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(load_text(corpus))
        return {"path": path}
    if command == "alias":
        return {"path": str(alias_gguf("smollm2-135m"))}
    model, tokenizer = _model(rest[0])
    return perplexity(model.eval(), _ids(tokenizer, rest[1]), int(rest[2]), int(rest[3]))


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
