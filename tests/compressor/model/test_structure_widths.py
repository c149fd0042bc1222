"""Per-layer widths (``extract_(..., uniform=False)``, ``apply_widths_``,
``structured.method.global_keep``): each block keeps its own widths and still computes what the
gated model computes; the config holds the widest block's widths and the list per block (of
the blocks kept), from which a skeleton is rebuilt with the extracted shapes, while a plain
``from_pretrained`` refuses the checkpoint (size mismatch); a malformed list is a one-line
load error; the global ranking drops the lowest scores of the kept blocks at top-k's total."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import FAMILY_NAMES, make_tiny_model

from lmcompress.compressor.model.families import decoder_blocks
from lmcompress.compressor.model.loading import load_model
from lmcompress.compressor.model.structure import (
    WIDTHS_FIELD,
    StructureGates,
    apply_widths_,
    attention_layout,
    block_shapes,
    extract_,
    structures_of,
)
from lmcompress.errors import ModelLoadError
from lmcompress.methods.structured.method import global_keep, top_keep

IDS = torch.randint(3, 250, (2, 12), generator=torch.Generator().manual_seed(0))
GQA = [f for f in FAMILY_NAMES if structures_of(make_tiny_model(f), ()).kv_groups is not None]


def _per_layer_keeps(model, kinds):
    """Three blocks keeping 1/8, 1/2 and 3/4 of their channels and 1, 2, 1 KV groups (the
    middle block removed when ``layers``), power-of-two scales."""
    g = torch.Generator().manual_seed(3)
    shape = block_shapes(model)[0]
    keep, gates = {}, {}
    counts = {
        "channels": [shape.channels // 8, shape.channels // 2, 3 * shape.channels // 4],
        "heads": [1, shape.groups, 1],
    }
    for kind, total in (("channels", shape.channels), ("heads", shape.groups)):
        if kind in kinds:
            keep[kind] = torch.stack([torch.randperm(total, generator=g) < n for n in counts[kind]])
            scale = 2.0 ** torch.randint(-1, 2, keep[kind].shape, generator=g).float()
            gates[kind] = keep[kind] * scale
    if "layers" in kinds:
        keep["layers"] = torch.tensor([True, False, True])
        gates["layers"] = keep["layers"][:, None].float().expand(-1, 2)
    return keep, gates, counts


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_per_layer_widths_compute_the_gated_model_and_reload_from_their_config(family, tmp_path):
    model = make_tiny_model(family, num_layers=3)
    kinds = ("channels", "layers") + (("heads",) if family in GQA else ())
    keep, values, counts = _per_layer_keeps(model, kinds)
    scales = {k: v.clone() for k, v in values.items() if k != "layers"}
    with torch.no_grad():
        gates = StructureGates(model, kinds)
        gates.values.update(values)
        gated = model(IDS).logits
        gates.remove()
        sizes = extract_(model, keep, scales, uniform=False)
        extracted = model(IDS).logits
    torch.testing.assert_close(extracted, gated, rtol=1e-5, atol=1e-5)
    structures = structures_of(model, ())
    widths = {structures.mlp_width: [counts["channels"][0], counts["channels"][2]]}
    if "heads" in kinds:  # blocks 0 and 2 keep one group each: the same width, no list
        assert model.config.num_key_value_heads == 1
    assert sizes[WIDTHS_FIELD] == widths and getattr(model.config, WIDTHS_FIELD) == widths
    assert getattr(model.config, structures.mlp_width) == counts["channels"][2]  # the widest
    model.save_pretrained(tmp_path)
    with pytest.raises(Exception, match=r"(?i)size|shape"):  # the plain loader: widest shapes
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    config = transformers.AutoConfig.from_pretrained(tmp_path)  # the widths through JSON
    skeleton = transformers.AutoModelForCausalLM.from_config(config).eval()
    apply_widths_(skeleton)
    skeleton.load_state_dict(model.state_dict(), strict=True)  # every shape as extracted
    assert all(p.requires_grad for p in skeleton.parameters())
    with torch.no_grad():
        torch.testing.assert_close(skeleton(IDS).logits, extracted, rtol=0, atol=0)


@pytest.mark.parametrize("family", GQA)
def test_per_layer_heads_are_listed_per_block(family):
    model = make_tiny_model(family, num_layers=3)
    keep = {"heads": torch.tensor([[True, False], [True, True], [False, True]])}
    _, rep, hd = attention_layout(model.config)
    sizes = extract_(model, keep, uniform=False)
    assert sizes[WIDTHS_FIELD] == {"num_key_value_heads": [1, 2, 1]}
    assert (sizes["num_key_value_heads"], sizes["num_attention_heads"]) == (2, 2 * rep)
    q_rows = [b.self_attn.q_proj.weight.shape[0] for b in decoder_blocks(model)]
    assert q_rows == [rep * hd, 2 * rep * hd, rep * hd]


def test_equal_counts_write_a_standard_config():
    model = make_tiny_model("llama")
    keep = torch.zeros(2, 64, dtype=torch.bool)
    keep[0, :10], keep[1, 5:15] = True, True
    sizes = extract_(model, {"channels": keep}, uniform=False)
    assert sizes == {"intermediate_size": 10} and not hasattr(model.config, WIDTHS_FIELD)


@pytest.mark.parametrize(
    "widths",
    [
        {"intermediate_size": [10]},  # one block short
        {"intermediate_size": [10, 0]},
        {"intermediate_size": [10, 65]},  # wider than the config
        {"intermediate_size": [10, 2.5]},
        {"hidden_size": [10, 10]},
        [10, 10],
    ],
)
def test_malformed_widths_are_one_line_load_errors(widths):
    config = make_tiny_model("llama").config
    setattr(config, WIDTHS_FIELD, widths)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ModelLoadError, match=WIDTHS_FIELD) as err:
        apply_widths_(model)
    assert "\n" not in str(err.value)


def test_global_keep_drops_the_lowest_scores_of_the_kept_blocks():
    scores = torch.tensor([[0.9, 0.1, 0.2, 0.8], [0.3, 0.7, 0.6, 0.5], [-5.0, -4.0, -3.0, -2.0]])
    # blocks 0 and 1 ranked together, 2 x 2 dropped: 0.1, 0.2, 0.3, 0.5
    keep = global_keep(scores, 2, torch.tensor([True, True, False]))
    assert keep[:2].tolist() == [[True, False, False, True], [False, True, True, False]]
    assert keep[2].equal(top_keep(scores, 2)[2])  # a removed block: top-k's
    # all three ranked together: block 2's scores are the lowest, but it keeps its best
    keep = global_keep(scores, 2)
    assert keep.sum() == 12 - 6 and keep[2].tolist() == [False, False, False, True]
    assert keep[:2].sum() == 5 and not keep[0, 1]


def test_global_keep_matches_brute_force_on_random_scores():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        scores = torch.randn(4, 6, generator=g)
        keep = global_keep(scores, 3)
        assert keep.sum() == 24 - 12 and bool(keep.any(dim=1).all())
        ranked = scores.clone()
        ranked[torch.arange(4), scores.argmax(1)] = float("inf")
        threshold = ranked.flatten().sort().values[11]
        assert keep.equal(ranked > threshold)


def test_a_per_layer_export_is_refused_as_a_checkpoint_in_one_line(tmp_path):
    model = make_tiny_model("llama")
    keep = torch.zeros(2, 64, dtype=torch.bool)
    keep[0, :10], keep[1, :20] = True, True
    extract_(model, {"channels": keep}, uniform=False)
    model.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="per-layer widths") as err:
        load_model(tmp_path)
    assert "\n" not in str(err.value)
