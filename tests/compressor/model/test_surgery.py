"""Surgery: layer selection by globs, the replacement walker, hooks that always go away, masks
as parametrizations baked into plain weights."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model
from torch import nn
from torch.nn.utils import parametrize
from transformers.pytorch_utils import Conv1D

from lmcompress.compressor.model.surgery import (
    LayerSelection,
    WeightMask,
    add_parametrization,
    bake,
    forward_hooks,
    replace_modules,
    weight_matrix,
)
from lmcompress.errors import ConfigError

IDS = torch.arange(12).reshape(2, 6)


def test_default_selection_is_every_decoder_linear_in_model_order():
    model = make_tiny_model("llama")
    chosen = LayerSelection().select(model)
    expected = [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.startswith("model.layers.")
    ]
    assert list(chosen) == expected and len(expected) == 2 * 7  # q k v o gate up down
    assert "lm_head" not in chosen
    assert all(chosen[name] is model.get_submodule(name) for name in chosen)


def test_include_and_exclude_globs():
    model = make_tiny_model("llama")
    mlp = LayerSelection(include=("*.mlp.*",), exclude=("*.down_proj",)).select(model)
    assert sorted(mlp) == sorted(
        f"model.layers.{i}.mlp.{p}" for i in range(2) for p in ("gate_proj", "up_proj")
    )
    first_block = LayerSelection(include=("model.layers.0.*",)).select(model)
    assert first_block and all(name.startswith("model.layers.0.") for name in first_block)
    with pytest.raises(ConfigError, match="no linear layer matches"):
        LayerSelection(include=("*.nothing",)).select(model)


def test_gpt2_conv1d_is_selected_and_viewed_as_out_by_in():
    model = make_tiny_model("gpt2")
    chosen = LayerSelection().select(model)
    assert chosen and all(isinstance(m, Conv1D) for m in chosen.values())
    c_fc = chosen["transformer.h.0.mlp.c_fc"]
    assert weight_matrix(c_fc).shape == (4 * 32, 32)  # Conv1D stores (in, out)
    assert weight_matrix(c_fc).data_ptr() == c_fc.weight.data_ptr()  # a view, not a copy


def test_a_tied_head_is_refused_an_untied_one_selected():
    tied = make_tiny_model("llama")  # tie_word_embeddings=True in conftest
    with pytest.raises(ConfigError, match="lm_head shares its weight"):
        LayerSelection(include=("lm_head",)).select(tied)
    untied = make_tiny_model("mistral")
    assert list(LayerSelection(include=("lm_head",)).select(untied)) == ["lm_head"]


def test_replace_modules_returns_what_it_replaced_and_leaves_the_rest():
    model = make_tiny_model("llama")
    reference = make_tiny_model("llama")
    names = list(LayerSelection(include=("*.mlp.*",)).select(model))
    untouched = {n: m for n, m in model.named_modules() if n.endswith("q_proj")}

    def factory(name, module):
        if name.endswith("up_proj"):
            return None  # leave it
        assert module is model.get_submodule(name)
        new = nn.Linear(module.in_features, module.out_features, bias=False)
        new.weight.data.copy_(module.weight)
        return new

    replaced = replace_modules(model, names, factory)
    assert sorted(replaced) == sorted(n for n in names if not n.endswith("up_proj"))
    assert all(model.get_submodule(n) is new for n, new in replaced.items())
    assert all(model.get_submodule(n) is m for n, m in untouched.items())
    with torch.no_grad():  # equal copies: the outputs do not move
        assert torch.equal(model(IDS).logits, reference(IDS).logits)


def test_forward_hooks_see_every_call_and_are_removed_even_after_an_exception():
    model = make_tiny_model("llama")
    layers = LayerSelection(include=("*.o_proj",)).select(model)
    seen = []
    with torch.no_grad(), forward_hooks(layers, lambda n, _m, _i, out: seen.append((n, out.shape))):
        model(IDS)
    assert [name for name, _ in seen] == list(layers) and seen[0][1] == (2, 6, 32)
    with pytest.raises(RuntimeError, match="boom"), forward_hooks(layers, lambda *_: None):
        raise RuntimeError("boom")
    assert all(not module._forward_hooks for module in layers.values())
    seen.clear()
    with torch.no_grad():
        model(IDS)
    assert seen == []


def test_weight_mask_parametrizes_then_bakes_into_a_plain_weight():
    torch.manual_seed(0)
    layer = nn.Linear(8, 4)
    original = layer.weight.detach().clone()
    mask = torch.rand(4, 8) > 0.5
    add_parametrization(layer, WeightMask(mask.float()))
    assert parametrize.is_parametrized(layer, "weight")
    assert torch.equal(layer.weight, original * mask)
    assert torch.equal(layer.parametrizations.weight.original, original)  # stored weight kept
    x = torch.randn(3, 8)
    masked_out = layer(x)
    bake(layer)
    assert not parametrize.is_parametrized(layer, "weight")
    assert isinstance(layer.weight, nn.Parameter) and torch.equal(layer.weight, original * mask)
    assert torch.equal(layer(x), masked_out)
    bake(layer)  # baking a plain layer is a no-op
    assert torch.equal(layer.weight, original * mask)
