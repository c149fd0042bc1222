import pytest
import torch
from conftest import make_tiny_model

from lmcompress.compressor.calibration.layerwise import compress_layerwise
from lmcompress.compressor.calibration.observers import (
    AbsMaxObserver,
    GramObserver,
    MeanAbsObserver,
    MinMaxObserver,
    observe,
)
from lmcompress.compressor.model.families import family_of
from lmcompress.compressor.report import LayerReport
from lmcompress.errors import ConfigError


def _batches(n=3, shape=(2, 5, 8), seed=0):
    g = torch.Generator().manual_seed(seed)
    # Channel scales 1..8 and an offset, so per-channel and per-tensor results differ.
    scale = torch.arange(1, shape[-1] + 1, dtype=torch.float32)
    return [torch.randn(shape, generator=g) * scale + 0.5 for _ in range(n)]


def _rows(batches):
    return torch.cat([b.reshape(-1, b.shape[-1]) for b in batches])  # (N, C)


def _ids(n=2, t=12):
    return torch.randint(3, 256, (n, t), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("per_channel", [False, True])
def test_absmax_and_minmax_equal_direct_computation(per_channel):
    batches = _batches()
    rows = _rows(batches)
    absmax, minmax = AbsMaxObserver(per_channel), MinMaxObserver(per_channel)
    for b in batches:
        absmax.update(b)
        minmax.add_batch(b)  # the layer-wise accumulator name does the same
    dims = {"dim": 0} if per_channel else {}
    assert absmax.absmax.shape == ((8,) if per_channel else ())
    assert torch.equal(absmax.absmax, rows.abs().amax(**dims))
    assert torch.equal(minmax.min, rows.amin(**dims))
    assert torch.equal(minmax.max, rows.amax(**dims))
    assert absmax.tokens == minmax.tokens == rows.shape[0] == 30


def test_mean_abs_and_gram_equal_direct_computation():
    batches = _batches()
    rows = _rows(batches)
    mean_abs, gram = MeanAbsObserver(), GramObserver()
    for b in batches:
        mean_abs.update(b)
        gram.update(b)
    torch.testing.assert_close(mean_abs.mean_abs, rows.abs().mean(dim=0), rtol=1e-6, atol=0)
    torch.testing.assert_close(gram.gram, rows.T @ rows, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gram.hessian(), 2 * rows.T @ rows / 30, rtol=1e-5, atol=1e-5)
    assert gram.tokens == 30


def test_low_precision_inputs_accumulate_in_float32():
    x = torch.full((4, 3), 1.0, dtype=torch.bfloat16)
    gram, mean_abs = GramObserver(), MeanAbsObserver()
    for _ in range(300):  # 1200 tokens: a bf16 sum would stall at 256
        gram.update(x)
        mean_abs.update(x)
    assert gram.gram.dtype == torch.float32
    assert torch.equal(gram.gram, torch.full((3, 3), 1200.0))
    assert torch.equal(mean_abs.mean_abs, torch.ones(3))


def test_update_does_not_track_gradients():
    x = torch.randn(4, 3, requires_grad=True)
    gram = GramObserver()
    gram.update(x * 2)
    assert not gram.gram.requires_grad


def test_empty_observer_and_changed_channels_are_errors():
    with pytest.raises(ValueError, match="observed nothing"):
        _ = AbsMaxObserver().absmax
    obs = MinMaxObserver(per_channel=True)
    obs.update(torch.zeros(2, 4))
    with pytest.raises(ValueError, match="channels changed"):
        obs.update(torch.zeros(2, 5))


def test_observe_linear_input_and_norm_output_on_a_model():
    """Inputs of a linear and outputs of a norm, checked against the tensors a plain hook saw."""
    model = make_tiny_model("llama")
    linear, norm = "model.layers.1.mlp.down_proj", "model.layers.0.post_attention_layernorm"
    seen = {}
    h1 = model.get_submodule(linear).register_forward_pre_hook(
        lambda _m, args: seen.setdefault("in", args[0].detach().clone())
    )
    h2 = model.get_submodule(norm).register_forward_hook(
        lambda _m, _a, out: seen.setdefault("out", out.detach().clone())
    )
    gram, absmax, minmax = GramObserver(), AbsMaxObserver(per_channel=True), MinMaxObserver()
    with torch.no_grad():
        with observe(model, {linear: [gram, absmax]}), observe(model, {norm: minmax}, on="output"):
            model(_ids())
    h1.remove(), h2.remove()
    x, y = seen["in"].reshape(-1, 64), seen["out"]
    assert gram.tokens == absmax.tokens == 24 and minmax.tokens == 24
    torch.testing.assert_close(gram.gram, x.T @ x, rtol=1e-5, atol=1e-5)
    assert torch.equal(absmax.absmax, x.abs().amax(dim=0))
    assert torch.equal(minmax.min, y.min()) and torch.equal(minmax.max, y.max())


@pytest.mark.parametrize("family", ["llama", "gpt2", "opt", "gpt_neox"])
def test_observe_whole_block_output_takes_first_element(family):
    """Decoder blocks return tuples (or tensors, by family): the hidden states are observed,
    and they equal the next block's input."""
    model = make_tiny_model(family)
    prefix = family_of(model).blocks
    out_obs, in_obs = AbsMaxObserver(per_channel=True), AbsMaxObserver(per_channel=True)
    with torch.no_grad():
        with observe(model, {f"{prefix}.0": out_obs}, on="output"):
            with observe(model, {f"{prefix}.1": in_obs}):
                model(_ids())
    assert out_obs.tokens == in_obs.tokens == 24
    assert torch.equal(out_obs.absmax, in_obs.absmax)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_observe_tuple_output_takes_first_element(family):
    """Attention modules return (output, probabilities): the output is what is observed."""
    model = make_tiny_model(family)
    model.set_attn_implementation("eager")  # eager returns the probabilities as a tensor
    attn, proj = {
        "llama": ("model.layers.0.self_attn", "model.layers.0.self_attn.o_proj"),
        "gpt2": ("transformer.h.0.attn", "transformer.h.0.attn.c_proj"),
    }[family]
    whole, last = AbsMaxObserver(per_channel=True), AbsMaxObserver(per_channel=True)
    with torch.no_grad(), observe(model, {attn: whole, proj: last}, on="output"):
        model(_ids())
    assert whole.absmax.shape == (32,)
    assert torch.equal(whole.absmax, last.absmax)


def test_observe_input_given_as_keyword():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    x = torch.randn(5, 3)
    obs = AbsMaxObserver(per_channel=True)
    with observe(model, {"0": obs}):
        model[0](input=x)
    assert torch.equal(obs.absmax, x.abs().amax(dim=0))


def test_observe_removes_hooks_on_exit_and_on_error():
    model = make_tiny_model("llama")
    obs = AbsMaxObserver()
    name = "model.layers.0.self_attn.q_proj"
    with pytest.raises(RuntimeError, match="boom"):
        with observe(model, {name: obs}, on="output"):
            model(_ids())
            raise RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"):
        with observe(model, {name: obs}):
            raise RuntimeError("boom")
    tokens = obs.tokens
    model(_ids())
    assert tokens == 24 and obs.tokens == tokens
    module = model.get_submodule(name)
    assert not module._forward_hooks and not module._forward_pre_hooks


def test_observe_rejects_unknown_names_and_sides():
    model = make_tiny_model("llama")
    with pytest.raises(ConfigError, match="no module named 'model.nope'"):
        with observe(model, {"model.nope": AbsMaxObserver()}):
            pass
    with pytest.raises(ConfigError, match="expected 'input' or 'output'"):
        with observe(model, {"model.norm": AbsMaxObserver()}, on="both"):
            pass


def test_observer_serves_as_layerwise_accumulator():
    """GramObserver plugs into compress_layerwise as the per-layer accumulator."""
    model = make_tiny_model("llama")
    name = "model.layers.1.self_attn.o_proj"
    data = _ids(4, 10)
    seen = []
    hook = model.get_submodule(name).register_forward_pre_hook(
        lambda _m, args: seen.append(args[0].reshape(-1, 32).clone())
    )
    with torch.no_grad():
        model(data)
    hook.remove()
    grams = {}

    def compress(layer_name, module, acc):
        grams[layer_name] = acc
        return LayerReport(layer_name, tuple(module.weight.shape), 0, 0, 0, 0)

    layers = {name: model.get_submodule(name)}
    compress_layerwise(model, data, layers, lambda *_: GramObserver(), compress, progress=False)
    x = torch.cat(seen)
    assert grams[name].tokens == 40
    torch.testing.assert_close(grams[name].gram, x.T @ x, rtol=1e-5, atol=1e-5)
