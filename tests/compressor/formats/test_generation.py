"""``generate()`` with a KV cache in every compressed runtime: the logits of cached decoding equal
the full-context logits (the same forward on the whole sequence), on every tiny family."""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILY_NAMES, make_tiny_model, make_tiny_tokenizer

from lmcompress import compress, load_compressed, save_compressed
from lmcompress.compressor.formats.base import CompressedLinear, installed
from lmcompress.compressor.formats.compose import compose_
from lmcompress.compressor.formats.int8_softmax import Int8Softmax
from lmcompress.methods.int8 import Int8Config
from lmcompress.methods.magnitude import MagnitudeConfig
from lmcompress.methods.svd import SVDConfig

DATA = torch.randint(3, 256, (4, 32), generator=torch.Generator().manual_seed(0))
RUNTIMES = {
    "nm_packed": ([MagnitudeConfig(sparsity="2:4")], "nm_packed"),
    "low_rank": ([SVDConfig(ratio=0.8)], "low_rank"),
    "int8": ([Int8Config()], "int8"),
    "int8_softmax": ([Int8Config(softmax_bits=8, bias_correction="head")], "int8"),
    "nm_packed_int8": ([MagnitudeConfig(sparsity="2:4"), Int8Config()], "nm_packed_int8"),
}


@pytest.mark.parametrize("runtime", sorted(RUNTIMES))
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_cached_decoding_equals_full_context(family, runtime, tmp_path):
    configs, fmt = RUNTIMES[runtime]
    model = make_tiny_model(family)
    reports = [compress(model, config, DATA) for config in configs]
    report = compose_(model, reports) if len(reports) > 1 else reports[0]
    save_compressed(model, tmp_path / "out", report, tokenizer=make_tiny_tokenizer())
    model, _, _ = load_compressed(tmp_path / "out", runtime="packed")
    formats = {m.format for m in model.modules() if isinstance(m, CompressedLinear)}
    assert formats == {fmt}  # the compressed runtime runs, not a dense copy
    if runtime == "int8_softmax":
        assert any(isinstance(t, Int8Softmax) for t in installed(model))
    prompt = DATA[:1, :8]
    out = model.generate(
        prompt,
        max_new_tokens=6,
        min_new_tokens=6,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    cached = torch.stack(out.logits)[:, 0]  # (6, V): the logits each decode step saw
    with torch.no_grad():
        full = model(out.sequences).logits[0, prompt.shape[1] - 1 : -1]  # (6, V)
    torch.testing.assert_close(cached, full, rtol=1e-5, atol=1e-5)
    assert torch.equal(cached.argmax(-1), out.sequences[0, prompt.shape[1] :])
