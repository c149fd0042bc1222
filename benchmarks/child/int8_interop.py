"""The ``interop`` row of ``benchmarks.int8``: an int8 output loaded by plain transformers
(its ``model.safetensors`` is in the compressed-tensors int-quantized layout), scored beside our
runtime and our simulation of compressed-tensors' scheme on the same weights.

    python -m benchmarks.child.int8_interop OUT EVAL_TOKENS CORPUS...   # prints one JSON line

Every model is scored by the library's evaluate step (:func:`lmcompress.jobs.evaluate.evaluate`)
on the same token ids (:class:`JobText`).
"""

from __future__ import annotations

import json
import sys

import torch
import transformers
from torch import nn

from lmcompress.compressor.formats.int8 import QuantLinear
from lmcompress.compressor.io.compressed_tensors import simulated_linear
from lmcompress.compressor.io.load import load_compressed
from lmcompress.jobs.evaluate import JobText, evaluate
from lmcompress.jobs.options import RunOptions


@torch.no_grad()
def run(out: str, eval_tokens: int, corpora: tuple[str, ...]) -> dict[str, dict[str, float]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    options = RunOptions(checkpoint=out, eval=corpora, eval_tokens=eval_tokens)
    text = JobText(tokenizer, options)

    def score(m: nn.Module) -> dict[str, float]:
        found = evaluate(m, tokenizer, text.corpora, options)
        return {corpus: result["perplexity"] for corpus, result in found.items()}

    loaded = score(model)
    ours, _, _ = load_compressed(out, runtime="packed")
    ours.eval()
    runtime = score(ours)  # our int8 runtime (absmax/127, the vLLM convention)
    for module in ours.modules():
        if isinstance(module, QuantLinear):
            module.forward = lambda x, _m=module: simulated_linear(_m, x)
    simulated = score(ours)
    return {"transformers": loaded, "simulated": simulated, "runtime": runtime}


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1], int(sys.argv[2]), tuple(sys.argv[3:]))))
