"""The line logged before a GGUF is dequantized: its size and parameter count, whatever the
model (it used to say "~15 s for 135M parameters" for every file)."""

from __future__ import annotations

import pytest
import transformers
from conftest import TINY_CONFIGS, make_tiny_model

from lmcompress.compressor.model.loading import dequantizing_line

SMOLLM2_135M = {  # SmolLM2-135M's shape
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "tie_word_embeddings": True,
}


@pytest.fixture
def gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"\0" * 2_500_000)  # only its size is read
    return path


def test_the_line_counts_the_parameters_of_the_config_it_is_given(gguf_file):
    tiny = make_tiny_model("llama")
    params = sum(p.numel() for p in tiny.parameters())
    line = dequantizing_line(gguf_file, TINY_CONFIGS["llama"]())
    assert line == (
        f"dequantizing {gguf_file} (2.5 MB): {params:,} parameters into float32 "
        f"({4 * params / 1e3:.1f} kB)"
    )
    assert "15 s" not in line and "135M" not in line


def test_a_135m_model_is_counted_as_one(gguf_file):
    line = dequantizing_line(gguf_file, transformers.LlamaConfig(**SMOLLM2_135M))
    assert ": 134,515,008 parameters into float32 (538.1 MB)" in line
