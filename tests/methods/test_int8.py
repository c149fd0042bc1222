"""The int8 method end to end on tiny models: W8A8 linears, the 8-bit softmax installed as a
model transform, export (compressed-tensors dense copy + our manifest) and reload by replay."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tiny_model

from lmcompress.api import compress
from lmcompress.cli.main import main
from lmcompress.compressor.formats.base import installed
from lmcompress.compressor.formats.int8 import QuantLinear
from lmcompress.compressor.formats.int8_softmax import Int8Softmax
from lmcompress.compressor.io.layout import MANIFEST
from lmcompress.compressor.io.load import load_compressed
from lmcompress.compressor.io.save import save_compressed
from lmcompress.compressor.model.attention import IMPLEMENTATION
from lmcompress.errors import ConfigError
from lmcompress.methods.int8 import Int8Config

TEXT = "\n\n".join(f"Document {i}. The quick brown fox jumps over the lazy dog." for i in range(60))


def _data(n=4, t=32, seed=0):
    return torch.randint(0, 256, (n, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"bits": 4}, "bits must be 8"),
        ({"softmax_bits": 4}, "softmax_bits must be 8"),
        ({"bias_correction": "head"}, "--softmax-bits 8"),
        ({"bias_correction": "row"}, "bias_correction must be one of"),
        ({"activations": "per-channel"}, "activations must be one of"),
        ({"group_size": -1}, "group_size must be >= 0"),
    ],
)
def test_bad_options_are_one_line_errors(options, message):
    with pytest.raises(ConfigError, match=message):
        Int8Config(**options)


def test_group_size_must_divide_every_layer():
    model = make_tiny_model("llama")
    with pytest.raises(ConfigError, match="does not divide"):
        compress(model, Int8Config(group_size=7))


@torch.no_grad()
def test_dynamic_w8a8_replaces_linears_and_stays_close():
    model = make_tiny_model("llama")
    ids = _data()
    ref = model(ids).logits
    report = compress(model, Int8Config())
    quantized = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(quantized) == len(report.layers) > 0
    out = model(ids).logits
    assert (out - ref).abs().max() / ref.abs().max() < 0.05
    assert not installed(model)  # no softmax transform unless asked


@torch.no_grad()
def test_softmax_transform_is_installed_and_removable():
    model = make_tiny_model("llama")
    ids = _data()
    float_logits = model(ids).logits
    compress(model, Int8Config(softmax_bits=8), data=ids)
    (transform,) = installed(model)
    assert isinstance(transform, Int8Softmax)
    assert model.config._attn_implementation == IMPLEMENTATION
    with_softmax = model(ids).logits
    transform.remove(model)
    assert model.config._attn_implementation != IMPLEMENTATION and not installed(model)
    without = model(ids).logits
    assert not torch.equal(with_softmax, without)  # the 8-bit softmax changes the outputs
    assert (without - float_logits).abs().max() < (with_softmax - float_logits).abs().max() * 10


@pytest.mark.parametrize("granularity", ["layer", "head"])
@torch.no_grad()
def test_bias_correction_is_estimated_per_attention_module(granularity):
    model = make_tiny_model("llama")
    report, stats = compress(
        model,
        Int8Config(softmax_bits=8, bias_correction=granularity, activations="static"),
        data=_data(8),
        return_stats=True,
    )
    bias = {k: v for k, v in stats.tensors.items() if k.startswith("softmax_bias.")}
    heads = model.config.num_attention_heads
    assert len(bias) == model.config.num_hidden_layers
    for beta in bias.values():
        assert beta.shape == (() if granularity == "layer" else (heads,))
        assert (beta > 0).all()  # rounding most tiny probabilities to 0 loses mass
    assert report.extra["softmax"]["bias"]["granularity"] == granularity
    assert all(m.input_scale is not None for m in model.modules() if isinstance(m, QuantLinear))


@pytest.mark.parametrize("family", ["llama", "gpt2", "opt"])
@torch.no_grad()
def test_save_and_replay_reproduce_the_full_scheme(family, tmp_path):
    model = make_tiny_model(family)
    ids = _data()
    config = Int8Config(softmax_bits=8, bias_correction="head", activations="static")
    report = compress(model, config, data=_data(8, seed=1))
    expected = model(ids).logits
    save_compressed(model, tmp_path / "out", report)
    manifest = json.loads((tmp_path / "out" / MANIFEST).read_text())
    assert manifest["transforms"][0]["kind"] == "int8_softmax"
    loaded, _, _ = load_compressed(tmp_path / "out", runtime="packed")
    assert any(isinstance(m, QuantLinear) for m in loaded.modules())
    assert len(installed(loaded)) == 1
    torch.testing.assert_close(loaded(ids).logits, expected, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_int8_head_quantizes_a_tied_head_and_keeps_the_embedding_float(tmp_path):
    model = make_tiny_model("llama")
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied
    embedding = model.model.embed_tokens.weight.clone()
    ids = _data()
    float_head = model(ids).logits
    report = compress(model, Int8Config(head="int8"))
    assert isinstance(model.lm_head, QuantLinear)
    assert torch.equal(model.model.embed_tokens.weight, embedding)
    assert model.config.tie_word_embeddings is False
    expected = model(ids).logits
    assert 0 < (expected - float_head).abs().max() < 0.05  # the head's own rounding
    save_compressed(model, tmp_path / "out", report)
    assert not json.loads((tmp_path / "out" / "config.json").read_text())["tie_word_embeddings"]
    loaded, _, _ = load_compressed(tmp_path / "out", runtime="packed")
    assert isinstance(loaded.lm_head, QuantLinear)
    assert torch.equal(loaded.model.embed_tokens.weight, embedding)
    torch.testing.assert_close(loaded(ids).logits, expected, rtol=0, atol=0)
    # the default leaves the head float (and a tied head is refused by --include)
    model = make_tiny_model("llama")
    compress(model, Int8Config())
    assert not isinstance(model.lm_head, QuantLinear)


def test_scales_stay_float32_in_a_bf16_save(tmp_path):
    from safetensors import safe_open

    model = make_tiny_model("llama")
    report = compress(model, Int8Config(activations="static"), data=_data(8))
    save_compressed(model, tmp_path / "out", report, dtype=torch.bfloat16)
    with safe_open(str(tmp_path / "out" / "compressed.safetensors"), framework="pt") as f:
        dtypes = {key.rsplit(".", 1)[-1]: f.get_tensor(key).dtype for key in f.keys()}
    assert dtypes["weight_scale"] == dtypes["input_scale"] == torch.float32
    assert dtypes["weight_q"] == torch.int8


def test_cli_end_to_end_and_eval(tiny_checkpoint, tmp_path, capsys):
    corpus = tmp_path / "c.txt"
    corpus.write_text(TEXT)
    out = tmp_path / "out"
    common = ["--seq-len", "32", "--eval-tokens", "0", "-q"]
    argv = [str(tiny_checkpoint), "--method", "int8", "--softmax-bits", "8"]
    argv += ["--bias-correction", "head", "--calib", str(corpus), "--nsamples", "4"]
    argv += ["--eval", str(corpus), "-o", str(out), *common]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "int8 on" in printed and "compressed-tensors layout" in printed
    pruned = json.loads((out / MANIFEST).read_text())["results"]["compressed"][str(corpus)]
    assert main(["eval", str(out), "--data", str(corpus), "--json", *common]) == 0
    scored = json.loads(capsys.readouterr().out)["perplexity"][str(corpus)]["perplexity"]
    assert scored == pytest.approx(pruned["perplexity"], rel=1e-5)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["format"] == "int-quantized"


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
@torch.no_grad()
def test_smoothing_keeps_the_float_model_and_flattens_its_inputs(family):
    from lmcompress.compressor.calibration.observers import AbsMaxObserver, observe
    from lmcompress.methods.int8.smooth import smooth_, smoothing_groups

    model = make_tiny_model(family)
    ids = _data()
    # give one input channel of every block an outlier, as real LLMs have
    for block in model.model.layers:
        block.input_layernorm.weight[3] = 30.0
    expected = model(ids).logits
    groups = smoothing_groups(model)
    firsts = [consumers[0] for _, consumers in groups]
    observers = {name: AbsMaxObserver(per_channel=True) for name in firsts}
    with observe(model, observers):
        model(ids)
    absmax = {name: obs.absmax for name, obs in observers.items()}
    factors = smooth_(model, absmax, alpha=0.5)
    torch.testing.assert_close(model(ids).logits, expected, rtol=1e-4, atol=1e-4)
    q_proj = "model.layers.0.self_attn.q_proj"
    spread_before = absmax[q_proj].max() / absmax[q_proj].median()
    spread_after = (absmax[q_proj] / factors[q_proj]).max() / (
        absmax[q_proj] / factors[q_proj]
    ).median()
    assert spread_after < spread_before / 2


def test_smoothing_refuses_other_families():
    with pytest.raises(ConfigError, match="--smooth-alpha supports"):
        compress(make_tiny_model("gpt2"), Int8Config(smooth_alpha=0.5), data=_data())


@torch.no_grad()
def test_smoothed_static_scheme_reloads_exactly(tmp_path):
    model = make_tiny_model("llama")
    ids = _data()
    config = Int8Config(smooth_alpha=0.5, activations="static")
    report = compress(model, config, data=_data(8, seed=1))
    assert (
        report.extra["smoothed_layers"] == 6 * model.config.num_hidden_layers
    )  # q k v gate up down
    expected = model(ids).logits
    save_compressed(model, tmp_path / "out", report)
    loaded, _, _ = load_compressed(tmp_path / "out", runtime="packed")
    torch.testing.assert_close(loaded(ids).logits, expected, rtol=1e-5, atol=1e-5)
