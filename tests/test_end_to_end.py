"""The real model, end to end: compress-model on SmolLM2-135M with a few evaluation windows."""

import json

import pytest
import torch
import transformers

from lmcompress.cli.main import main
from lmcompress.compressor.export import (
    COMPRESSED_TENSORS,
    MANIFEST,
    load_compressed,
    save_compressed,
)
from lmcompress.evaluation.corpora import tokenize
from lmcompress.evaluation.perplexity import perplexity

pytestmark = pytest.mark.real_model


def test_smollm2_magnitude_2_4_end_to_end(tmp_path, capsys):
    out = tmp_path / "smollm2-2of4"
    argv = [
        "smollm2-135m",
        "--method",
        "magnitude",
        "--sparsity",
        "2:4",
        "--eval",
        "wiki-test",
        "--eval-tokens",
        "2048",
        "--seq-len",
        "512",
        "-o",
        str(out),
        "-q",
    ]
    assert main(argv) == 0
    assert "wiki-test" in capsys.readouterr().out
    results = json.loads((out / MANIFEST).read_text())["results"]
    dense = results["dense"]["wiki-test"]
    pruned = results["compressed"]["wiki-test"]
    assert dense["windows"] == 4
    assert 10 < dense["perplexity"] < 40  # a trained model (random weights: ~50,000)
    assert pruned["perplexity"] > 5 * dense["perplexity"]  # 2:4 magnitude hurts a small model

    # Plain transformers scores the exported directory the same (pruned weights are zeros).
    plain = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    ids = tokenize(tokenizer, "wiki-test", 2048)
    again = perplexity(plain, ids, 512, progress=False)
    assert again.perplexity == pytest.approx(pruned["perplexity"], rel=1e-4)

    # The packed form rebuilds the same weights bit for bit.
    model, _, report = load_compressed(out)
    plain_state = plain.state_dict()
    for layer in report.layers:
        assert torch.equal(
            model.get_submodule(layer.name).weight, plain_state[f"{layer.name}.weight"]
        )
    assert len(report.layers) == 210

    # Stored at fp16, the packed 2:4 file is 56.25 % of the pruned layers' dense fp16 bytes.
    half = save_compressed(model, tmp_path / "fp16", report, dtype=torch.float16)
    dense_fp16 = sum(layer.params for layer in report.layers) * 2
    ratio = (half / COMPRESSED_TENSORS).stat().st_size / dense_fp16
    assert ratio <= 0.57, ratio
