"""A structured extraction, then 4-bit round to nearest on GGUF's grid, exported with ``--export
gguf``: llama.cpp's format holds the smaller model (``--channel-multiple 32``: the MLP width a
multiple of Q4_0's block of 32), and transformers' GGUF loader builds it with the smaller config
and our runtime's logits exactly; without the multiple the 4-bit stage refuses in one line."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
import yaml

from lmcompress.cli.main import main
from lmcompress.compressor.io.load import load_compressed

pytest.importorskip("gguf")
test_gguf_export = pytest.importorskip("compressor.io.test_gguf_export")


def _run(tmp_path, multiple: int):
    config = transformers.LlamaConfig(
        vocab_size=test_gguf_export.VOCAB, hidden_size=64, intermediate_size=128,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    checkpoint, text = tmp_path / "ck", tmp_path / "text.txt"
    model.save_pretrained(checkpoint)
    test_gguf_export._bpe_tokenizer().save_pretrained(checkpoint)
    text.write_text(test_gguf_export.TEXT * 5)
    first = {"method": "structured", "structure": ["channels", "layers"], "ratio": 0.65}
    rtn = {"method": "rtn", "bits": 4, "group_size": 32, "scale_dtype": "float16"}
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"stages": [first | {"channel_multiple": multiple}, rtn]}))
    out = tmp_path / f"out{multiple}"
    argv = ["--config", str(recipe), str(checkpoint), "--calib", str(text), "--seq-len", "32",
            "--nsamples", "8", "--export", "gguf", "-o", str(out), "-q"]  # fmt: skip
    return main(argv), out


def test_a_structured_model_exports_to_gguf_and_transformers_loads_it(tmp_path, capsys):
    code, out = _run(tmp_path, 32)
    assert code == 0, capsys.readouterr().err
    config = json.loads((out / "config.json").read_text())
    width, blocks = config["intermediate_size"], config["num_hidden_layers"]
    assert width % 32 == 0 and (width, blocks) != (128, 4), (width, blocks)
    ours, _, _ = load_compressed(out, runtime="packed")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        out, gguf_file="model.gguf", dtype=torch.float32
    ).eval()
    assert (loaded.config.intermediate_size, loaded.config.num_hidden_layers) == (width, blocks)
    ids = torch.randint(
        3, test_gguf_export.VOCAB, (2, 32), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, ours(ids).logits)


def test_without_the_multiple_the_4_bit_stage_refuses_in_one_line(tmp_path, capsys):
    code, out = _run(tmp_path, 1)
    error = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and not out.exists()
    assert "does not divide" in error[-1] and "input columns" in error[-1]
