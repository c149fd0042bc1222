"""Structures and their extraction (``compressor/model/structure.py``): on every family the
extracted model computes what the gated model computes (scales folded in, to float rounding),
saves as a standard checkpoint that plain transformers loads with the smaller config, and
keeps the right rows: KV groups with their own query heads, channels across gate/up/down,
blocks renumbered for the KV cache; bad keeps are one-line errors."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import FAMILY_NAMES, make_tiny_model

from lmcompress.compressor.model.families import decoder_blocks
from lmcompress.compressor.model.structure import (
    StructureGates,
    attention_layout,
    block_shape,
    block_shapes,
    extract_,
    structures_of,
)
from lmcompress.compressor.model.surgery import weight_matrix
from lmcompress.errors import ConfigError

IDS = torch.randint(3, 250, (2, 12), generator=torch.Generator().manual_seed(0))
GQA = [f for f in FAMILY_NAMES if structures_of(make_tiny_model(f), ()).kv_groups is not None]


def _keeps(model, kinds, seed=1):
    """Random keeps of uniform width (half the channels, one KV group, the first block) and
    power-of-two scales (exact products), with the gate values they mean."""
    g = torch.Generator().manual_seed(seed)
    shapes = block_shapes(model)
    blocks, shape = len(shapes), shapes[0]
    keep, scales, gates = {}, {}, {}
    for kind, count, kept in (
        ("channels", shape.channels, shape.channels // 2),
        ("heads", shape.groups, 1),
    ):
        if kind in kinds:
            keep[kind] = torch.stack(
                [torch.randperm(count, generator=g) < kept for _ in range(blocks)]
            )
            scales[kind] = 2.0 ** torch.randint(-1, 2, (blocks, count), generator=g).float()
            gates[kind] = keep[kind] * scales[kind]
    if "layers" in kinds:
        keep["layers"] = torch.arange(blocks) != 1
        scales["layers"] = 2.0 ** torch.randint(-1, 2, (blocks, 2), generator=g).float()
        gates["layers"] = keep["layers"][:, None] * scales["layers"]
    return keep, scales, gates


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_the_extracted_model_computes_what_the_gated_one_does_and_reloads(family, tmp_path):
    model = make_tiny_model(family)
    kinds = ("channels", "layers") + (("heads",) if family in GQA else ())
    keep, scales, values = _keeps(model, kinds)
    with torch.no_grad():
        dense = model(IDS).logits
        gates = StructureGates(model, kinds)
        gates.values.update(values)
        gated = model(IDS).logits
        gates.remove()
        assert model(IDS).logits.equal(dense)  # the hooks are gone
        sizes = extract_(model, keep, scales)
        extracted = model(IDS).logits
    assert not torch.allclose(gated, dense, atol=1e-3)  # the gates did something
    torch.testing.assert_close(extracted, gated, rtol=1e-5, atol=1e-5)
    model.save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    config = reloaded.config
    for field, value in sizes.items():
        assert getattr(config, field) == value
    assert config.num_hidden_layers == 1  # the second block went
    with torch.no_grad():
        torch.testing.assert_close(reloaded(IDS).logits, extracted, rtol=0, atol=0)


@pytest.mark.parametrize("family", GQA)
def test_a_kv_group_goes_with_its_own_query_heads(family):
    """Group 1 kept alone: q keeps rows [n_rep·hd, 2·n_rep·hd), k and v rows [hd, 2·hd), o the
    matching columns (a swapped axis or a group size of ``hd`` for q would fail)."""
    model = make_tiny_model(family)
    block = decoder_blocks(model)[0]
    q, k, v, o = (
        weight_matrix(block.get_submodule(p)).detach().clone()
        for p in structures_of(model, ()).kv_groups
    )
    _, rep, hd = attention_layout(model.config)
    blocks = len(decoder_blocks(model))
    extract_(model, {"heads": torch.tensor([[False, True]] * blocks)})
    new = [weight_matrix(block.get_submodule(p)) for p in structures_of(model, ()).kv_groups]
    assert new[0].equal(q[rep * hd : 2 * rep * hd])
    assert new[1].equal(k[hd : 2 * hd]) and new[2].equal(v[hd : 2 * hd])
    assert new[3].equal(o[:, rep * hd : 2 * rep * hd])
    assert model.config.num_attention_heads == rep and model.config.num_key_value_heads == 1


def test_a_channel_is_a_row_of_gate_and_up_and_a_column_of_down():
    model = make_tiny_model("llama")
    mlp = decoder_blocks(model)[0].mlp
    gate, up, down = (
        m.weight.detach().clone() for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    )
    keep = torch.zeros(2, 64, dtype=torch.bool)
    keep[:, [3, 40]] = True
    scales = torch.ones(2, 64)
    scales[0, 40] = 4.0
    extract_(model, {"channels": keep}, {"channels": scales})
    assert mlp.gate_proj.weight.equal(gate[[3, 40]]) and mlp.up_proj.weight.equal(up[[3, 40]])
    assert mlp.down_proj.weight.equal(down[:, [3, 40]] * torch.tensor([1.0, 4.0]))
    assert mlp.down_proj.in_features == 2 and mlp.gate_proj.out_features == 2


def test_block_shape_counts_every_parameter():
    """Tiny llama: hidden 32, MLP 64, 2 KV groups of 2 query heads of 8. A channel is a row of
    gate and up and a column of down (3 · 32); a group 2 · 8 rows of q, 8 of k and v, 2 · 8
    columns of o (6 · 8 · 32); what neither holds is the two RMSNorms (2 · 32)."""
    model = make_tiny_model("llama")
    shape = block_shape(model, decoder_blocks(model)[0])
    assert (shape.channels, shape.channel_params) == (64, 96)
    assert (shape.groups, shape.group_params) == (2, 1536)
    assert shape.params - 64 * 96 - 2 * 1536 == 64


def test_removed_blocks_renumber_the_cache_slots_and_generate():
    model = make_tiny_model("llama", num_layers=3)
    extract_(model, {"layers": torch.tensor([False, True, True])})
    blocks = decoder_blocks(model)
    assert [b.self_attn.layer_idx for b in blocks] == [0, 1] and model.config.num_hidden_layers == 2
    with torch.no_grad():
        cached = model.generate(IDS[:1], max_new_tokens=5, do_sample=False)
        stepwise = IDS[:1]
        for _ in range(5):  # no cache: the whole sequence each step
            nxt = model(stepwise, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            stepwise = torch.cat([stepwise, nxt], dim=1)
    assert cached.equal(stepwise)


@pytest.mark.parametrize(
    ("family", "keep", "message"),
    [
        ("gpt2", {"heads": torch.ones(2, 4, dtype=torch.bool)}, "derives its head size"),
        ("llama", {"rows": torch.ones(2, 4, dtype=torch.bool)}, "unknown structure 'rows'"),
        ("llama", {"channels": torch.tensor([[True] * 64, [True] * 63 + [False]])}, "one width"),
        ("llama", {"channels": torch.zeros(2, 64, dtype=torch.bool)}, "every channel"),
        ("llama", {"heads": torch.zeros(2, 2, dtype=torch.bool)}, "every head"),
        ("llama", {"layers": torch.zeros(2, dtype=torch.bool)}, "every decoder block"),
    ],
)
def test_bad_keeps_are_one_line_errors(family, keep, message):
    model = make_tiny_model(family)
    with pytest.raises(ConfigError, match=message) as err:
        extract_(model, keep)
    assert "\n" not in str(err.value)
