"""8-bit softmax and its offline bias correction (lmcompress.methods.int8.softmax)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from conftest import VOCAB, make_tiny_model

from lmcompress.compressor.formats.int8_softmax import (
    SoftmaxQuantizer,
    dequantize_probs,
    fold_bias,
    quantize_probs,
    quantize_probs_int,
)
from lmcompress.compressor.model.attention import attention_hook
from lmcompress.errors import ConfigError
from lmcompress.methods.int8.bias_plot import bias_magnitudes, plot_bias_heatmap
from lmcompress.methods.int8.softmax import SoftmaxBiasAccumulator, calibrate_softmax, estimate_bias


def _reference_q(p: torch.Tensor, scale: float) -> list[int]:
    """Integer reference: the float32 quotient p / s (the spec), rounded half to even and
    clamped by Python integer arithmetic."""
    out = []
    for v in (p.float().numpy() / np.float32(scale)).astype(np.float32).tolist():
        r = math.floor(v)
        frac = v - r
        if frac > 0.5 or (frac == 0.5 and r % 2):
            r += 1
        out.append(min(max(r, 0), 255))
    return out


@pytest.mark.parametrize("scale", [1 / 255, 1 / 256])
def test_quantize_probs_matches_integer_reference(scale):
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(3, 5, 17) * 3, dim=-1)
    edges = torch.tensor([0.0, 1.0, 0.5 * scale, 1.5 * scale, 254.5 * scale, 255.5 * scale])
    p = torch.cat([p.flatten(), edges.float()])
    q = quantize_probs_int(p, scale)
    assert q.dtype == torch.uint8
    assert q.tolist() == _reference_q(p, scale)
    assert torch.equal(quantize_probs(p, scale), q.float() * scale)
    # 1 is the top code at 1/255 and clamps to it at 1/256 (as does 255.5 steps).
    assert q[-5].item() == 255 and q[-1].item() == 255
    if scale == 1 / 256:  # exact ties in float32: half to even
        assert q[-4:-1].tolist() == [0, 2, 254]


def test_scale_range_is_zero_excluded_to_one_included():
    """``s`` in (0, 1]: the largest legal step, 1, rounds each probability to 0 or 1 (half to
    even); 0, above 1 and NaN are one-line errors."""
    p = torch.tensor([0.0, 0.3, 0.5, 0.51, 1.0])
    assert quantize_probs_int(p, 1.0).tolist() == [0, 0, 0, 1, 1]
    assert torch.equal(quantize_probs(p, 1.0), torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0]))
    for bad in (0.0, 1.0 + 1e-6, float("nan")):
        with pytest.raises(ConfigError, match="softmax scale must lie in"):
            quantize_probs_int(p, bad)


def test_offset_only_on_positive_entries():
    p = torch.tensor([[0.0, 1e-4, 0.3, 0.6999]])
    out = quantize_probs(p, 1 / 255, offset=0.001)
    assert out[0, 0].item() == 0.0  # a masked key keeps 0
    assert out[0, 1].item() == pytest.approx(0.001)  # rounded to 0, corrected
    assert out[0, 2].item() == pytest.approx(round(0.3 * 255) / 255 + 0.001)


@pytest.mark.parametrize("bad", [0.0, -1 / 255, float("nan"), 2.0])
def test_bad_scale_is_a_config_error(bad):
    with pytest.raises(ConfigError, match="scale"):
        quantize_probs(torch.rand(4), bad)
    with pytest.raises(ConfigError, match="scale"):
        SoftmaxQuantizer(bad)


def test_unknown_granularity_is_a_config_error():
    acc = SoftmaxBiasAccumulator()
    acc.add_batch("a", torch.softmax(torch.randn(1, 2, 3, 3), -1))
    with pytest.raises(ConfigError, match="granularity"):
        acc.bias("channel")


def _synthetic_probs(a: torch.Tensor, k: int, rows: int, scale: float, seed: int) -> torch.Tensor:
    """(1, H, rows, 2k + 1 + 3) softmax outputs of logits log(p), with a known bias.

    Per head h: 2k small entries in antithetic pairs (x, a_h·s − x), x ~ U(0, a_h·s) with
    a_h ≤ 1/2, so every one rounds to 0 (its error is itself, mean a_h·s/2) and a row's small
    mass is exactly k·a_h·s; one large entry holds the rest, 1 − k·a_h·s, a whole number of steps
    when k·a_h is an integer (error 0); three masked keys (logit −inf, p = 0) must not count.
    So β_h = 2k · (a_h·s/2) / (2k + 1) = k·a_h·s / (2k + 1).
    """
    g = torch.Generator().manual_seed(seed)
    h = a.numel()
    x = torch.rand(h, rows, k, generator=g, dtype=torch.float64) * (a * scale)[:, None, None]
    small = torch.cat([x, (a * scale)[:, None, None] - x], dim=-1)  # (H, rows, 2k)
    big = 1 - small.sum(-1, keepdim=True)
    masked = torch.zeros(h, rows, 3, dtype=torch.float64)
    p = torch.cat([big, small, masked], dim=-1)
    return torch.softmax(p.log().float(), dim=-1)[None]


def test_estimator_unbiased_on_synthetic_logits():
    scale, k = 1 / 255, 7
    a = torch.tensor([1, 2, 3], dtype=torch.float64) / k  # k·a whole steps, a ≤ 1/2
    acc = SoftmaxBiasAccumulator(scale)
    for seed in range(3):  # several batches: the sums must add up
        acc.add_batch("attn", _synthetic_probs(a, k, 500, scale, seed))
    expected = k * a * scale / (2 * k + 1)
    head = acc.bias("head")["attn"].double()
    assert head.shape == (3,)
    assert acc.counts["attn"].tolist() == [3 * 500 * (2 * k + 1)] * 3
    assert torch.allclose(head, expected, rtol=1e-4, atol=0)
    layer = acc.bias("layer")["attn"]
    assert layer.shape == ()
    assert layer.item() == pytest.approx(expected.mean().item(), rel=1e-4)


def test_estimator_exact_on_constructed_rows():
    """Rows of 11 entries: 10 at 0.2 steps (error 0.2 s each) and one at 253 steps (error 0):
    β = 2 s / 11 exactly; every entry is valid; masked (0) entries are not counted."""
    scale = 1 / 255
    p = torch.full((1, 1, 2, 12), 0.2 * scale, dtype=torch.float64)
    p[..., 0] = 253 * scale
    p[..., -1] = 0.0  # a masked key
    acc = SoftmaxBiasAccumulator(scale)
    acc.add_batch("attn", p.float())
    assert acc.counts["attn"].item() == 22
    assert acc.bias("layer")["attn"].item() == pytest.approx(2 * scale / 11, rel=1e-5)
    lengths = acc.length_bias()["attn"]
    assert lengths.shape == (1, 13)
    assert lengths[0, 11].item() == pytest.approx(2 * scale / 11, rel=1e-5)


@pytest.mark.parametrize("granularity", ["layer", "head"])
def test_folded_equals_explicit(granularity):
    torch.manual_seed(0)
    scale = 1 / 256
    probs = torch.softmax(torch.randn(2, 4, 9, 9) * 4, dim=-1)
    probs = probs.masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1), 0.0)
    beta = torch.tensor(0.0007) if granularity == "layer" else torch.tensor([1e-4, 0, 2e-3, 5e-4])
    quantizer = SoftmaxQuantizer.from_bias({"attn": beta}, scale)
    assert torch.allclose(quantizer.zero_point["attn"], -beta / scale)
    folded = quantizer.quantize("attn", probs)
    offset = beta if beta.dim() == 0 else beta.reshape(-1, 1, 1)
    explicit = quantize_probs(probs, scale, offset)
    assert torch.allclose(folded, explicit, rtol=0, atol=1e-7)
    assert not torch.allclose(folded, quantize_probs(probs, scale), rtol=0, atol=1e-5)
    # The folded form from its integer codes alone, as a deployed kernel would apply it.
    q = quantize_probs_int(probs, scale)
    z = fold_bias(beta, scale)
    z = z if z.dim() == 0 else z.reshape(-1, 1, 1)
    assert torch.equal(dequantize_probs(q, scale, z, probs > 0), folded)


def _tokens(seed: int, n: int = 2, t: int = 24) -> torch.Tensor:
    return torch.randint(3, VOCAB, (n, t), generator=torch.Generator().manual_seed(seed))


def _big_offsets(model, value: float) -> dict[str, torch.Tensor]:
    with attention_hook(model) as hook:
        names = [hook.name(m) for m in model.modules() if hook.name(m) is not None]
    return {name: torch.tensor(value) for name in names if name.endswith(("attn", "attention"))}


def test_correction_keeps_the_model_causal():
    model = make_tiny_model("llama")
    a = _tokens(0, n=1)
    b = a.clone()
    b[:, 12:] = _tokens(1, n=1)[:, 12:]  # same prefix, different future
    acc = calibrate_softmax(model, _tokens(2), progress=False)
    bias = {k: v + 0.01 for k, v in acc.bias("head").items()}  # large: a leak would show
    quantizer = SoftmaxQuantizer.from_bias(bias)
    with torch.no_grad(), quantizer.applied(model):
        out_a, out_b = model(a).logits, model(b).logits
    assert torch.allclose(out_a[:, :12], out_b[:, :12], rtol=0, atol=1e-6)
    assert not torch.allclose(out_a[:, 12:], out_b[:, 12:])

    # The negative control: the same offset added to every key attends to the future.
    def everywhere(_module, probs):
        return quantize_probs(probs, 1 / 255) + 0.01

    with torch.no_grad(), attention_hook(model, transform=everywhere):
        leak_a, leak_b = model(a).logits, model(b).logits
    assert not torch.allclose(leak_a[:, :12], leak_b[:, :12], rtol=0, atol=1e-4)


def test_every_family_through_the_hook(family_model):
    """For every family: β recomputed here from the float probabilities the hook sees (the mean
    of ``p − s · round(p / s)`` over valid entries, per head, and pooled over the heads per
    layer), and the corrected 8-bit softmax equal to ``s · round(p / s) + β`` on valid keys
    written as a plain transform."""
    family, model = family_model
    data = _tokens(3)
    probs = {}
    with torch.no_grad(), attention_hook(model) as hook:
        hook.observe = lambda module, p: probs.setdefault(hook.name(module), []).append(p)
        float_logits = model(data).logits
    acc = calibrate_softmax(model, data, progress=False)
    head, layer = acc.bias("head"), acc.bias("layer")
    assert sorted(head) == sorted(layer) == sorted(probs) and len(head) == 2, family
    step = torch.tensor(1 / 255)  # float32: p / s is a float32 quotient
    for name, batches in probs.items():
        p = torch.cat(batches).transpose(0, 1).flatten(1)  # (heads, entries)
        err = p.double() - torch.round(p.float() / step).double() * step.double()
        valid = (p > 0).sum(-1)
        torch.testing.assert_close(
            head[name].double(), err.sum(-1) / valid, rtol=1e-5, atol=1e-9, msg=family
        )
        torch.testing.assert_close(
            layer[name].double(), err.sum() / valid.sum(), rtol=1e-5, atol=1e-9, msg=family
        )
    assert estimate_bias(model, data, "layer", progress=False).keys() == layer.keys()

    with torch.no_grad():
        with SoftmaxQuantizer().applied(model):
            plain = model(data).logits
        with SoftmaxQuantizer.from_bias(head).applied(model):
            corrected = model(data).logits
        with attention_hook(model) as hook:
            hook.transform = lambda module, p: torch.where(
                p > 0, torch.round(p / step) * step + head[hook.name(module)][:, None, None], 0.0
            ).to(p.dtype)
            expected = model(data).logits
    # s · (q − z') (the folded form) and s · q + β differ by float32 rounding, ~1e-7 in the
    # logits; β itself moves them by 3e-5 or more in every family
    torch.testing.assert_close(corrected, expected, rtol=0, atol=2e-6, msg=family)
    assert (corrected - plain).abs().max() > 1e-5 and not torch.equal(plain, float_logits)


def test_zero_bias_is_plain_8bit():
    model = make_tiny_model("qwen2")
    data = _tokens(4)
    zero = {name: torch.zeros(()) for name in estimate_bias(model, data, progress=False)}
    with torch.no_grad():
        with SoftmaxQuantizer().applied(model):
            plain = model(data).logits
        with SoftmaxQuantizer.from_bias(zero).applied(model):
            folded = model(data).logits
    assert torch.equal(plain, folded)


def test_bias_report_and_heatmap(tmp_path):
    model = make_tiny_model("gpt2")
    bias = estimate_bias(model, _tokens(5), "head", progress=False)
    report = bias_magnitudes(bias, scale=1 / 255)
    text = json.dumps(report)
    assert json.loads(text) == report
    assert len(report["layers"]) == 2
    first = report["layers"][0]
    name = next(iter(bias))
    assert first["name"] == name
    assert first["per_head"] == pytest.approx(bias[name].tolist())
    assert first["mean"] == pytest.approx(bias[name].mean().item())
    assert first["per_head_steps"] == pytest.approx((bias[name] * 255).tolist(), rel=1e-5)
    png = plot_bias_heatmap(bias, tmp_path / "bias.png", scale=1 / 255)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_quantizer_state_round_trip(tmp_path):
    from safetensors.torch import load_file, save_file

    bias = {"model.layers.0.self_attn": torch.tensor([1e-4, 2e-4]), "b": torch.tensor(3e-4)}
    quantizer = SoftmaxQuantizer.from_bias(bias, 1 / 256)
    save_file(quantizer.state_tensors(), tmp_path / "softmax.safetensors")
    json.dump(quantizer.meta(), (tmp_path / "meta.json").open("w"))
    loaded = SoftmaxQuantizer.from_state(
        load_file(tmp_path / "softmax.safetensors"), json.load((tmp_path / "meta.json").open())
    )
    assert loaded.scale == quantizer.scale
    assert loaded.zero_point.keys() == quantizer.zero_point.keys()
    for name, z in quantizer.zero_point.items():
        assert torch.equal(loaded.zero_point[name], z)


def test_the_op_equals_the_probability_quantizer_within_one_step():
    """The installed 8-bit softmax runs ``lmcompress::int8_softmax`` on the scores; it gives
    what quantizing the float softmax gives, but where ``p / s`` lies within rounding of a
    half-step boundary (the op's own exp), and never more than one step apart."""
    from lmcompress.compressor.formats.int8_softmax import DEFAULT_SCALE, SoftmaxQuantizer

    generator = torch.Generator().manual_seed(0)
    heads, length = 4, 48
    scores = 3 * torch.randn(2, heads, length, length, generator=generator)  # (B, H, T, T)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    mask = torch.zeros(length, length).masked_fill(~causal, torch.finfo(torch.float32).min)
    beta = 0.3 * DEFAULT_SCALE * torch.rand(heads, generator=generator)  # per head, < 1 step
    quantizer = SoftmaxQuantizer.from_bias({"attn": beta})
    quantizer.names = lambda _module: "attn"
    module = torch.nn.Identity()
    by_op = quantizer.softmax(module, scores, mask[None, None])
    probs = torch.softmax(scores + mask, dim=-1)
    by_probs = quantizer(module, probs)
    difference = (by_op - by_probs).abs()
    assert difference.max() <= DEFAULT_SCALE * (1 + 1e-5)
    assert (difference <= 1e-6).float().mean() > 0.999
    assert torch.all(by_op[..., ~causal] == 0)  # masked keys get no offset: causality holds


@torch.no_grad()
def test_bias_correction_lowers_the_error_on_held_out_windows_per_head_most():
    """β estimated on calibration windows, measured on other windows (issue 22): the mean
    |p̂ − p| and the residual bias |E[p̂ − p]| of every head both drop, and per-head β leaves
    less bias than per-layer β when heads differ (here: each head's queries scaled, so its
    attention is sharper or flatter than its neighbours')."""
    model = make_tiny_model("llama").eval()
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    factors = [6.0, 0.2, 2.0, 1.0][: config.num_attention_heads]
    for layer in model.model.layers:
        for head, factor in enumerate(factors):
            layer.self_attn.q_proj.weight[head * head_dim : (head + 1) * head_dim] *= factor
    generator = torch.Generator().manual_seed(1)
    calib = torch.randint(3, VOCAB, (8, 128), generator=generator)
    held_out = torch.randint(3, VOCAB, (8, 128), generator=generator)
    quantizers = {"none": SoftmaxQuantizer()}
    for granularity in ("layer", "head"):
        bias = estimate_bias(model, calib, granularity, progress=False)
        quantizers[granularity] = SoftmaxQuantizer.from_bias(bias)
    abs_error = dict.fromkeys(quantizers, 0.0)
    head_bias: dict[str, list[torch.Tensor]] = {k: [] for k in quantizers}
    allowed_total = 0

    def observe(module, probs):
        nonlocal allowed_total
        allowed = probs > 0  # (B, H, Tq, Tk): the causal mask's zeros are not quantized
        allowed_total += int(allowed.sum())
        for key, quantizer in quantizers.items():
            error = (quantizer.quantize(hook.name(module), probs) - probs).double()
            abs_error[key] += float(error.abs()[allowed].sum())
            head_bias[key].append((error * allowed).sum((0, 2, 3)) / allowed.sum((0, 2, 3)))

    with attention_hook(model) as hook:
        hook.observe = observe
        model(input_ids=held_out, use_cache=False)
    mae = {k: v / allowed_total for k, v in abs_error.items()}
    bias = {k: torch.cat(v).abs().mean().item() for k, v in head_bias.items()}
    assert mae["layer"] < mae["none"] and mae["head"] <= mae["layer"]
    assert bias["layer"] < bias["none"] / 3  # measured: 1.4e-4 -> 2.2e-5
    assert bias["head"] < bias["layer"] / 2  # measured: 2.2e-5 -> 4.3e-6
