"""``torch.compile`` of every compressed runtime computes what eager does (within rounding): the
ops have fake implementations, so the compiled graph runs the same kernels."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model, make_tiny_tokenizer

from lmcompress import compress, load_compressed, save_compressed
from lmcompress.compressor.formats.compose import compose_
from lmcompress.methods.int8 import Int8Config
from lmcompress.methods.magnitude import MagnitudeConfig
from lmcompress.methods.svd import SVDConfig

DATA = torch.randint(3, 256, (4, 32), generator=torch.Generator().manual_seed(0))
RUNTIMES = {
    "nm_packed": [MagnitudeConfig(sparsity="2:4")],
    "low_rank": [SVDConfig(ratio=0.8)],
    "int8": [Int8Config()],
    "int8_softmax": [Int8Config(softmax_bits=8, bias_correction="head")],
    "nm_packed_int8": [MagnitudeConfig(sparsity="2:4"), Int8Config()],
}


@pytest.mark.parametrize("runtime", sorted(RUNTIMES))
def test_compiled_equals_eager(runtime, tmp_path):
    model = make_tiny_model("llama")
    reports = [compress(model, config, DATA) for config in RUNTIMES[runtime]]
    report = compose_(model, reports) if len(reports) > 1 else reports[0]
    save_compressed(model, tmp_path / "out", report, tokenizer=make_tiny_tokenizer())
    model, _, _ = load_compressed(tmp_path / "out", runtime="packed")
    torch._dynamo.reset()
    compiled = torch.compile(model.forward, dynamic=False)
    # 64 tokens (packed N:M unpacks, then torch's matmul) and 3 (its kernels read the packed
    # form: eager calls them directly, the compiled graph through the ops)
    for ids in (DATA[:2], DATA[:1, :3]):
        with torch.inference_mode():
            eager = model(input_ids=ids, use_cache=False).logits
            graph = compiled(input_ids=ids, use_cache=False).logits
        torch.testing.assert_close(graph, eager, rtol=1e-4, atol=1e-4)
