"""The real model, end to end: compress-model on SmolLM2-135M with a few evaluation windows."""

import json

import pytest
import torch
import transformers

from lmcompress.cli.main import main
from lmcompress.compressor.io.layout import COMPRESSED_TENSORS, MANIFEST
from lmcompress.compressor.io.load import load_compressed
from lmcompress.compressor.io.save import save_compressed
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
        "1024",
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
    assert dense["windows"] == 2
    assert 10 < dense["perplexity"] < 40  # a trained model (random weights: ~50,000)
    assert pruned["perplexity"] > 5 * dense["perplexity"]  # 2:4 magnitude hurts a small model

    # Plain transformers scores the exported directory the same (pruned weights are zeros).
    plain = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    ids = tokenize(tokenizer, "wiki-test", 1024)
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


def test_smollm2_2_4_packed_runtime_matches_dense_in_56_percent_of_the_bytes(tmp_path, capsys):
    """Issue 9: a 2:4 export reloaded with runtime=packed holds the pruned linears in <= 0.6x
    their dense fp16 bytes and scores the same perplexity as runtime=dense. Each eval runs in
    its own process, so its peak RSS is that of the load and evaluation alone."""
    import subprocess
    import sys

    out = tmp_path / "mag-2of4"
    argv = ["smollm2-135m", "--method", "magnitude", "--sparsity", "2:4", "--eval"]  # no eval
    argv += ["--skip-dense", "--save-dtype", "bfloat16", "-o", str(out)]
    assert main([*argv, "-q"]) == 0
    capsys.readouterr()
    results = {}
    for runtime in ("packed", "dense"):
        command = [sys.executable, "-m", "lmcompress.cli.main", "eval", str(out), "--json", "-q"]
        command += ["--eval-tokens", "1024", "--runtime", runtime]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        results[runtime] = json.loads(done.stdout)
    ppl = {key: res["perplexity"]["wiki-test"]["perplexity"] for key, res in results.items()}
    assert ppl["packed"] == pytest.approx(ppl["dense"], rel=1e-5)
    packed, dense = results["packed"]["load"], results["dense"]["load"]
    assert packed["layers"] == dense["layers"] == 210
    assert packed["ratio_to_dense_fp16"] <= 0.6  # bf16 values + 2-bit positions: 0.5625
    assert dense["ratio_to_dense_fp16"] == pytest.approx(1.0)
    assert packed["peak_rss_mib"] < dense["peak_rss_mib"]  # after loading, before evaluating
    print(json.dumps({key: {**res["load"], "ppl": ppl[key]} for key, res in results.items()}))
