"""The family table and layer selection, on a tiny model of every supported family."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import FAMILY_NAMES, make_tiny_model
from torch import nn
from transformers.pytorch_utils import Conv1D

from lmcompress.compressor.model.families import FAMILIES, decoder_blocks, family_of
from lmcompress.compressor.model.surgery import LayerSelection, weight_matrix
from lmcompress.errors import ConfigError, ModelLoadError

# Linear layers per decoder block: q, k, v, o + gate, up, down (Llama-like); GPT-2 and GPT-NeoX
# fuse q/k/v into one layer; OPT has q, k, v, out + fc1, fc2.
LINEARS_PER_BLOCK = {
    "gemma3_text": 7,
    "llama": 7,
    "mistral": 7,
    "qwen2": 7,
    "gpt2": 4,
    "gpt_neox": 4,
    "opt": 6,
}
NUM_LAYERS = 2  # every tiny config in conftest


def _block_linears(model: nn.Module, blocks: str) -> dict[str, nn.Module]:
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, (nn.Linear, Conv1D)) and name.startswith(f"{blocks}.")
    }


def test_every_tiny_family_is_in_the_table():
    assert set(FAMILY_NAMES) <= set(FAMILIES)
    assert set(LINEARS_PER_BLOCK) == set(FAMILY_NAMES)


def test_family_and_blocks(family_model):
    model_type, model = family_model
    family = family_of(model)
    assert family is FAMILIES[model_type] is family_of(model_type)
    assert family.needs_bos == (model_type == "gemma3_text")
    blocks = decoder_blocks(model)
    assert isinstance(blocks, nn.ModuleList)
    assert len(blocks) == model.config.num_hidden_layers == NUM_LAYERS


def test_head_and_embedding_paths(family_model):
    _, model = family_model
    family = family_of(model)
    assert model.get_submodule(family.embeddings[0]) is model.get_input_embeddings()
    assert all(isinstance(model.get_submodule(p), nn.Embedding) for p in family.embeddings)
    assert model.get_submodule(family.head) is model.get_output_embeddings()


def test_default_selection_is_exactly_the_block_linears(family_model):
    model_type, model = family_model
    family = family_of(model)
    chosen = LayerSelection().select(model)
    expected = _block_linears(model, family.blocks)
    assert list(chosen) == list(expected)  # same names, in model order
    assert all(chosen[name] is expected[name] for name in expected)
    assert len(chosen) == LINEARS_PER_BLOCK[model_type] * NUM_LAYERS
    assert family.head not in chosen
    assert not any(name.startswith(family.embeddings) for name in chosen)
    if model_type == "gpt2":
        assert all(isinstance(module, Conv1D) for module in chosen.values())


def test_weight_matrix_is_an_out_by_in_view(family_model):
    _, model = family_model
    for name, module in LayerSelection().select(model).items():
        W = weight_matrix(module)  # (out, in)
        in_features = W.shape[1]
        if isinstance(module, Conv1D):
            assert W.shape == (module.nf, module.weight.shape[0])
        else:
            assert W.shape == (module.out_features, module.in_features)
        assert W.data_ptr() == module.weight.data_ptr(), name
        inputs = torch.randn(4, in_features, generator=torch.Generator().manual_seed(1))
        bias = module.bias if module.bias is not None else 0
        with torch.no_grad():
            torch.testing.assert_close(module(inputs), inputs @ W.T + bias)


def test_weight_matrix_writes_through(family_model):
    _, model = family_model
    for module in LayerSelection().select(model).values():
        with torch.no_grad():
            weight_matrix(module)[0, 1] = 123.0
        stored = module.weight[1, 0] if isinstance(module, Conv1D) else module.weight[0, 1]
        assert stored.item() == 123.0


def test_include_and_exclude_globs(family_model):
    model_type, model = family_model
    blocks = family_of(model).blocks
    first_block = LayerSelection(include=(f"{blocks}.0.*",)).select(model)
    assert len(first_block) == LINEARS_PER_BLOCK[model_type]
    assert all(name.startswith(f"{blocks}.0.") for name in first_block)
    all_but_first = LayerSelection(exclude=(f"{blocks}.0.*",)).select(model)
    assert len(all_but_first) == LINEARS_PER_BLOCK[model_type] * (NUM_LAYERS - 1)
    assert not set(first_block) & set(all_but_first)
    first = next(iter(first_block))  # e.g. model.layers.0.self_attn.q_proj
    leaf = first.rpartition(".")[2]
    only_leaf = LayerSelection(include=(f"*.{leaf}",)).select(model)
    assert list(only_leaf) == [
        first.replace(f"{blocks}.0.", f"{blocks}.{i}.", 1) for i in range(NUM_LAYERS)
    ]


@pytest.mark.parametrize(
    "selection",
    [LayerSelection(include=("no.such.layer*",)), LayerSelection(exclude=("*",))],
    ids=["include-nothing", "exclude-everything"],
)
def test_no_match_is_a_config_error(selection):
    model = make_tiny_model("llama")
    with pytest.raises(ConfigError, match="no linear layer matches"):
        selection.select(model)


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_tied_head_explicitly_included_is_refused(model_type):
    model = make_tiny_model(model_type)
    assert model.lm_head.weight is model.get_input_embeddings().weight  # tied
    with pytest.raises(ConfigError, match="tied"):
        LayerSelection(include=("lm_head",)).select(model)


def test_untied_head_can_be_included():
    model = make_tiny_model("mistral")
    assert model.lm_head.weight is not model.get_input_embeddings().weight
    chosen = LayerSelection(include=("lm_head",)).select(model)
    assert list(chosen) == ["lm_head"] and chosen["lm_head"] is model.lm_head


def test_unsupported_model_type_names_supported_ones():
    config = transformers.BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=64,
    )
    bert = transformers.BertModel(config)
    for call in (family_of, decoder_blocks, LayerSelection().select):
        with pytest.raises(ModelLoadError, match="unsupported architecture 'bert'") as err:
            call(bert)
        assert all(name in str(err.value) for name in FAMILIES)
    with pytest.raises(ModelLoadError, match="supported model types: .*llama"):
        family_of("foo")
    with pytest.raises(ModelLoadError, match="unsupported architecture None"):
        family_of(nn.Linear(2, 2))
