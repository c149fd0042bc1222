"""Learned structured extraction (``subnet --structure``, ``methods/subnet/structured.py``): the
expected kept parameters against brute force, the straight-through sampler and its hard and
disabled modes, extraction equal to the hard-gated model (scales folded), the constraint
pulling the keep rates to the budget, the end-to-end method, bad options."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import make_tiny_model, make_tiny_tokenizer

from lmcompress import compress, load_compressed, save_compressed
from lmcompress.compressor.model.structure import WIDTHS_FIELD, block_shapes, extract_
from lmcompress.errors import ConfigError
from lmcompress.methods.subnet import SubnetConfig
from lmcompress.methods.subnet.structured import ParamsConstraint, StructureSampler

KINDS = ("heads", "channels", "layers")
DATA = torch.randint(3, 250, (8, 16), generator=torch.Generator().manual_seed(0))


def _sampler(model, logits=None, ratio=0.7, seed=0):
    g = torch.Generator().manual_seed(seed)
    blocks = len(block_shapes(model))
    logits = logits or {
        "heads": torch.randn(blocks, 2, generator=g),
        "channels": torch.randn(blocks, 64, generator=g),
        "layers": torch.randn(blocks, generator=g) + 2,
    }
    return StructureSampler(model, KINDS, logits, ratio)


def test_expected_params_equal_the_sum_over_every_keep_pattern_of_a_small_case():
    """Two blocks, logits on channels 0-1 and the blocks only (the rest ±30: certain): the
    expectation over the 2^4 joint keep patterns, weighted by their probabilities, equals
    the closed form."""
    model = make_tiny_model("llama")
    shape = block_shapes(model)[0]
    logits = {
        "heads": torch.full((2, 2), 30.0),
        "channels": torch.full((2, 64), 30.0),
        "layers": torch.tensor([0.3, -0.8]),
    }
    logits["channels"][0, 0], logits["channels"][1, 1] = -0.5, 1.2
    sampler = _sampler(model, logits)
    p = {k: torch.sigmoid(v).double() for k, v in logits.items()}
    total = 0.0
    for c0, c1, b0, b1 in itertools.product([0, 1], repeat=4):
        prob = (p["channels"][0, 0] if c0 else 1 - p["channels"][0, 0]) * (
            p["channels"][1, 1] if c1 else 1 - p["channels"][1, 1]
        )
        prob = prob * (p["layers"][0] if b0 else 1 - p["layers"][0])
        prob = prob * (p["layers"][1] if b1 else 1 - p["layers"][1])
        params = b0 * (shape.params - (1 - c0) * shape.channel_params)
        params += b1 * (shape.params - (1 - c1) * shape.channel_params)
        total += float(prob) * params
    # the other channels and groups are kept with probability 1 - sigmoid(-30) ≈ 1 - 1e-13
    torch.testing.assert_close(float(sampler.expected_params().detach()), total, rtol=1e-6, atol=0)
    sampler.remove()


def test_samples_are_exact_keeps_with_gradients_and_the_modes_switch():
    model = make_tiny_model("llama")
    with torch.no_grad():
        dense = model(DATA).logits
    sampler = _sampler(model)
    model(DATA)  # a forward draws a sample
    channels = sampler.gates.values["channels"]
    assert set(channels.detach().unique().tolist()) <= {0.0, 1.0}  # scales start at 1
    channels.sum().backward()
    assert (
        sampler.logits["channels"].grad is not None and sampler.scales["channels"].grad is not None
    )
    sampler.enabled = False
    with torch.no_grad():
        assert model(DATA).logits.equal(dense)
    sampler.enabled, sampler.hard = True, True
    with torch.no_grad():
        model(DATA)
    keep = sampler.keeps()
    assert sampler.gates.values["channels"].equal(keep["channels"].float())
    assert sampler.gates.values["layers"].equal(keep["layers"].float()[:, None].expand(-1, 2))
    sampler.remove()
    with torch.no_grad():
        assert model(DATA).logits.equal(dense)


@pytest.mark.parametrize("per_layer", [False, True])
def test_extraction_equals_the_hard_gated_model_with_the_scales_folded(per_layer):
    model = make_tiny_model("llama", num_layers=3)
    sampler = _sampler(model, ratio=0.6)
    sampler.per_layer = per_layer
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for scale in sampler.scales.values():
            scale.copy_(2.0 ** torch.randint(-1, 2, scale.shape, generator=g).float())
    sampler.hard = True
    with torch.no_grad():
        gated = model(DATA).logits
    keep = sampler.keeps()
    scales = {k: v.detach() for k, v in sampler.scales.items()}
    sampler.remove()
    counts = keep["channels"][keep["layers"]].sum(1)
    assert (len(set(counts.tolist())) > 1) == per_layer  # random logits: widths differ
    extract_(model, keep, scales, uniform=not per_layer)
    with torch.no_grad():
        torch.testing.assert_close(model(DATA).logits, gated, rtol=1e-5, atol=1e-5)
    kept = sum(p.numel() for p in model.model.layers.parameters())
    assert abs(kept / (3 * block_shapes(make_tiny_model("llama"))[0].params) - 0.6) < 0.05


def test_the_lagrangian_pulls_the_expected_parameters_to_the_budget():
    """From keep probabilities 1/2 everywhere (expected 0.5 of the decoder), a target of 0.8:
    SGD on the logits with the multipliers ascending moves the expectation to the target (a
    sign error in the reversal or the deviation would drive it away)."""
    model = make_tiny_model("llama")
    blocks = len(block_shapes(model))
    logits = {"heads": torch.zeros(blocks, 2), "channels": torch.zeros(blocks, 64)}
    sampler = StructureSampler(model, ("heads", "channels"), logits, ratio=0.8)
    constraint = ParamsConstraint(sampler, "lagrangian", weight=1.0)
    params = list(sampler.logits.values())
    groups = [{"params": params, "lr": 50.0}, {"params": [constraint.multipliers], "lr": 1.0}]
    opt = torch.optim.SGD(groups)  # the paper's lr on the logits
    first = None
    for step in range(300):
        loss, logs = constraint(step)
        first = logs["keep_dev"] if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert first > 0.3 and logs["keep_dev"] < 0.02  # |E / total − 0.8| / 0.8
    sampler.remove()


def test_the_method_extracts_at_the_budget():
    model = make_tiny_model("llama", num_layers=4)
    config = SubnetConfig(structure=KINDS, sparsity=0.3, steps=6, prior="wanda")
    report = compress(model, config, DATA)
    assert abs(report.extra["kept_fraction"] - 0.7) < 0.05
    assert report.extra["steps"] == 6 and report.extra["hard_ppl"]
    kept = sum(p.numel() for p in model.model.layers.parameters())
    assert kept == report.extra["decoder_params_kept"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"structure": ("channels",), "sparsity": "2:4"}, "no N:M"),
        ({"structure": ("rows",), "sparsity": 0.2}, "each once"),
        ({"structure": ("channels",), "sparsity": 0.2, "blockwise": True}, "end to end"),
        ({"sparsity": 0.2, "distill_steps": 5}, "add --structure"),
    ],
)
def test_bad_options_are_one_line_errors(options, message):
    with pytest.raises(ConfigError, match=message):
        SubnetConfig(**options)


def test_a_structure_the_family_lacks_fails_before_any_work():
    model = make_tiny_model("gpt2")
    with pytest.raises(ConfigError, match="derives its head size"):
        compress(model, SubnetConfig(structure=("heads",), sparsity=0.2, steps=1), DATA)


def test_per_layer_widths_rank_the_logits_across_blocks_and_load_with_lmcompress(tmp_path):
    """``--widths per-layer`` end to end: the same kept parameters as uniform widths, blocks
    of different widths, and ``load_compressed`` rebuilds it exactly; the card says so."""
    model = make_tiny_model("llama", num_layers=3)
    config = SubnetConfig(
        structure=("heads", "channels"), sparsity=0.3, steps=4, prior="none", widths="per-layer"
    )
    report = compress(model, config, DATA)
    widths = getattr(model.config, WIDTHS_FIELD)
    assert len(set(widths["intermediate_size"])) > 1  # random logits: blocks differ
    assert model.config.intermediate_size == max(widths["intermediate_size"])
    uniform = make_tiny_model("llama", num_layers=3)
    compress(uniform, SubnetConfig(structure=("heads", "channels"), sparsity=0.3, steps=4,
                                   prior="none"), DATA)  # fmt: skip
    assert (
        report.extra["decoder_params_kept"]
        == sum(p.numel() for p in uniform.model.layers.parameters())
        == sum(p.numel() for p in model.model.layers.parameters())
    )
    out = save_compressed(model, tmp_path / "out", report, tokenizer=make_tiny_tokenizer())
    loaded, _, _ = load_compressed(out)
    with torch.no_grad():
        torch.testing.assert_close(loaded(DATA).logits, model(DATA).logits, rtol=0, atol=0)
    assert "per-layer widths" in (out / "README.md").read_text()


def test_widths_need_a_structure():
    with pytest.raises(ConfigError, match="add --structure"):
        SubnetConfig(sparsity=0.2, widths="per-layer")


def test_channel_multiple_rounds_the_learned_width():
    """``channel_multiple`` reaches the learned extraction: the kept channels of every block a
    multiple of it (the same logits without it keep a width that is not one)."""
    model = make_tiny_model("llama", num_layers=4)
    g = torch.Generator().manual_seed(5)
    logits = {"channels": torch.randn(4, 64, generator=g)}
    plain = StructureSampler(model, ("channels",), logits, 0.8).keeps()["channels"]
    sampler = StructureSampler(model, ("channels",), logits, 0.8, channel_multiple=4)
    rounded = sampler.keeps()["channels"]
    assert set(plain.sum(1).tolist()) != set(rounded.sum(1).tolist())
    assert all(k % 4 == 0 for k in rounded.sum(1).tolist())
