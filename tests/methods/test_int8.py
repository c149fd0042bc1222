"""The int8 method end to end on tiny models: W8A8 linears, the 8-bit softmax installed as a
model transform, export (compressed-tensors dense copy + our manifest) and reload by replay."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_qwen3, make_tiny_model

from lmcompress.api import compress
from lmcompress.cli.main import main
from lmcompress.compressor.formats.base import installed
from lmcompress.compressor.formats.int8 import QuantLinear
from lmcompress.compressor.formats.int8_softmax import Int8Softmax
from lmcompress.compressor.io.layout import MANIFEST
from lmcompress.compressor.io.load import load_compressed
from lmcompress.compressor.io.save import save_compressed
from lmcompress.compressor.model.attention import IMPLEMENTATION, attention_hook
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


def _on_grid(t, absmax):
    """``t`` rounded onto the symmetric int8 grid of step ``absmax / 127`` (float32 step and
    quotient, round half to even, clamp), as float64: the module doc of ``formats.quant``."""
    step = absmax.float() / 127
    return torch.clamp(torch.round(t.float() / step), -128, 127).double() * step.double()


def _layer_io(model, ids, kind):
    """{name: (input, output)} of every ``kind`` module of ``model`` on ``ids``, from hooks."""
    seen = {}
    hooks = [
        module.register_forward_hook(
            lambda _m, args, out, n=n: seen.__setitem__(n, (args[0].detach(), out.detach()))
        )
        for n, module in model.named_modules()
        if isinstance(module, kind)
    ]
    model(ids)
    for hook in hooks:
        hook.remove()
    return seen


@torch.no_grad()
def test_dynamic_w8a8_replaces_linears_and_computes_the_w8a8_product():
    """Each layer, on the inputs it really sees, against ``Q(x) Q(W)ᵀ + b`` written here in
    float64: per-token activation steps and per-row weight steps ``absmax / 127``. Only the
    float32 rescale rounds, so the tolerance is a few float32 ulps."""
    model = make_tiny_model("llama")
    dense = {
        n: (m.weight.detach().clone(), m.bias)
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and n != "lm_head"
    }
    report = compress(model, Int8Config())
    seen = _layer_io(model, _data(), QuantLinear)
    assert sorted(seen) == sorted(layer.name for layer in report.layers) == sorted(dense)
    for name, (x, y) in seen.items():
        W, bias = dense[name]  # (out, in)
        x2 = x.reshape(-1, x.shape[-1])  # (tokens, in)
        want = (
            _on_grid(x2, x2.abs().amax(1, keepdim=True))
            @ _on_grid(W, W.abs().amax(1, keepdim=True)).T
        )
        if bias is not None:
            want = want + bias.double()
        got = y.reshape(-1, y.shape[-1]).double()
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * want.abs().max().item())
    assert not installed(model)  # no softmax transform unless asked


STEP = torch.tensor(1 / 255)  # the 8-bit softmax's step: float32, p / s in float32


@torch.no_grad()
def test_softmax_transform_is_installed_and_removable(monkeypatch):
    """Installed, every attention layer takes its probabilities from the 8-bit op, which gives
    ``round(p / s)`` steps of torch's float softmax of the same scores (its own exp may move a
    probability lying on a rounding boundary by one step: at most a few in a thousand);
    removed, the model is exactly the int8 linears alone."""
    import lmcompress.compressor.formats.int8_softmax as fmt

    calls, op = [], fmt.int8_softmax

    def spy(scores, mask, offset, scale):
        q, out = op(scores, mask, offset, scale)
        calls.append((scores, mask, offset, out))
        return q, out

    monkeypatch.setattr(fmt, "int8_softmax", spy)
    ids = _data()
    linears_only = make_tiny_model("llama")
    compress(linears_only, Int8Config())
    plain = linears_only(ids).logits
    model = make_tiny_model("llama")
    compress(model, Int8Config(softmax_bits=8), data=ids)
    (transform,) = installed(model)
    assert isinstance(transform, Int8Softmax)
    assert model.config._attn_implementation == IMPLEMENTATION
    calls.clear()
    with_softmax = model(ids).logits
    assert len(calls) == model.config.num_hidden_layers
    for scores, mask, offset, out in calls:
        assert offset is None  # no bias correction asked for
        x = scores.float() + (0.0 if mask is None else mask.float())  # (B, H, Tq, Tk)
        expected = torch.round(torch.softmax(x, dim=-1) / STEP)
        steps = out / STEP
        assert (steps - expected).abs().max() < 1 + 1e-3
        assert ((steps - expected).abs() > 1e-3).float().mean() < 3e-3
    assert not torch.equal(with_softmax, plain)
    transform.remove(model)
    assert model.config._attn_implementation != IMPLEMENTATION and not installed(model)
    assert torch.equal(model(ids).logits, plain)


@pytest.mark.parametrize("granularity", ["layer", "head"])
@torch.no_grad()
def test_bias_correction_is_estimated_per_attention_module(granularity):
    """β = mean of ``p − s · round(p / s)`` over the valid (``p > 0``) probabilities of the float
    model on the calibration data, per layer or per head, recomputed here from hooks;
    the static input scales are the calibration inputs' absmax / 127."""
    data = _data(8)
    model = make_tiny_model("llama")
    probs, inputs = {}, _layer_io(model, data, torch.nn.Linear)  # the float model
    with attention_hook(model) as hook:
        hook.observe = lambda module, p: probs.setdefault(hook.name(module), []).append(p)
        model(data)
    report, stats = compress(
        model,
        Int8Config(softmax_bits=8, bias_correction=granularity, activations="static"),
        data=data,
        return_stats=True,
    )
    bias = {
        k.removeprefix("softmax_bias."): v
        for k, v in stats.tensors.items()
        if k.startswith("softmax_bias.")
    }
    assert sorted(bias) == sorted(probs) and len(bias) == model.config.num_hidden_layers
    for name, batches in probs.items():
        p = torch.cat(batches).double().transpose(0, 1).flatten(1)  # (heads, entries)
        err = (p - torch.round(p.float() / STEP).double() * STEP.double()) * (p > 0)
        count = (p > 0).sum(-1)
        expected = err.sum() / count.sum() if granularity == "layer" else err.sum(-1) / count
        torch.testing.assert_close(bias[name].double(), expected, rtol=1e-5, atol=1e-9)
    assert report.extra["softmax"]["bias"]["granularity"] == granularity
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            absmax = inputs[name][0].abs().amax()
            assert module.input_scale.item() == pytest.approx(absmax.item() / 127, rel=1e-6)


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


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "qwen3"])
@torch.no_grad()
def test_smoothing_keeps_the_float_model_and_flattens_its_inputs(family):
    from lmcompress.compressor.calibration.observers import AbsMaxObserver, observe
    from lmcompress.methods.int8.smooth import smooth_, smoothing_groups

    model = make_qwen3() if family == "qwen3" else make_tiny_model(family)
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


@torch.no_grad()
def test_static_scales_after_smoothing_cover_the_inputs_the_layers_now_see():
    """With SmoothQuant each layer's input is divided by ``s`` (folded into its producer), so
    its static scale is the smoothed input's absmax / 127. Oracle: the inputs the quantized
    layers receive on the calibration windows. Block 0's q/k/v read the embeddings through the
    smoothed norm alone, so there the match is exact; later layers see inputs perturbed by the
    int8 layers before them (a few %)."""
    model = make_tiny_model("llama")
    for block in model.model.layers:  # an outlier channel, as real LLMs have: s is far from 1
        block.input_layernorm.weight[3] = 30.0
    calibration = _data(8, seed=1)
    compress(model, Int8Config(smooth_alpha=0.5, activations="static"), data=calibration)
    seen: dict[str, float] = {}
    quantized = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}

    def record(name):
        return lambda _m, args: seen.__setitem__(
            name, max(seen.get(name, 0.0), float(args[0].abs().amax()))
        )

    handles = [m.register_forward_pre_hook(record(n)) for n, m in quantized.items()]
    model(input_ids=calibration, use_cache=False)
    for handle in handles:
        handle.remove()
    assert len(seen) == 7 * model.config.num_hidden_layers
    for name, module in quantized.items():
        scale, expected = float(module.input_scale), seen[name] / 127
        exact = name.startswith("model.layers.0.self_attn.") and name[-6] in "qkv"
        assert scale == pytest.approx(expected, rel=1e-5 if exact else 0.1), (
            f"{name}: input_scale {scale:.4g}, its inputs' absmax / 127 is {expected:.4g}"
        )


@torch.no_grad()
def test_smoothing_with_dynamic_activations_still_observes_and_smooths():
    """SmoothQuant needs the calibration absmax whatever the activation mode: with dynamic
    activations every q/k/v/gate/up/down is smoothed too, and the norm's outlier channel is
    divided down (its factor s_3 is ~sqrt(30 / max|W[:, 3]|), far above 1)."""
    model = make_tiny_model("llama")
    for block in model.model.layers:
        block.input_layernorm.weight[3] = 30.0
    report = compress(model, Int8Config(smooth_alpha=0.5), data=_data(8, seed=1))
    assert report.extra["activations"] == "dynamic"
    assert report.extra["smoothed_layers"] == 6 * model.config.num_hidden_layers
    for block in model.model.layers:
        assert float(block.input_layernorm.weight[3]) < 10.0


def test_report_bytes_are_the_codes_and_scales_stored():
    """Per group of 8 inputs a scale of 4 bytes rides on 8 one-byte codes (1.5 bytes a weight):
    the report's compressed bytes are the stored tensors' (bias aside, as for every format)."""
    model = make_tiny_model("llama")
    report = compress(model, Int8Config(group_size=8))
    for layer in report.layers:
        module = model.get_submodule(layer.name)
        stored = module.weight_q.nbytes + module.weight_scale.nbytes
        assert layer.bytes_compressed == stored == 1.5 * layer.params, layer.name
