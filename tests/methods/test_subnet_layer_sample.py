"""``subnet --structure layers --layer-sample topk`` (``sampling.topk_sample``): every training
sample drops exactly the blocks the budget removes, drawn by Gumbel top-k (a sample without
replacement from the softmax of the logits), with a straight-through gradient through a sigmoid
around the threshold between the last kept and the first dropped perturbed logit."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model

from lmcompress import compress
from lmcompress.compressor.model.structure import block_shapes
from lmcompress.errors import ConfigError
from lmcompress.methods.subnet import SubnetConfig
from lmcompress.methods.subnet.sampling import gumbel_noise, topk_sample
from lmcompress.methods.subnet.structured import StructureSampler

DATA = torch.randint(3, 250, (8, 16), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("kept", [1, 3, 5])
def test_topk_keeps_exactly_the_top_perturbed_logits_with_the_threshold_sigmoids_gradient(kept):
    g = torch.Generator().manual_seed(kept)
    logits = torch.randn(6, generator=g).requires_grad_()
    noise, tau = gumbel_noise((6,), generator=g), 0.7
    mask = topk_sample(logits, kept, tau, noise)
    z = (logits + noise).detach()
    order = z.sort(descending=True).values
    assert mask.detach().equal((z >= order[kept - 1]).float()) and int(mask.sum()) == kept
    weights = torch.arange(1.0, 7.0)
    (mask * weights).sum().backward()
    soft = torch.sigmoid((z - (order[kept - 1] + order[kept]) / 2) / tau)
    torch.testing.assert_close(logits.grad, weights * soft * (1 - soft) / tau)


def test_topk_keeping_everything_is_ones_and_keeping_none_is_refused():
    logits = torch.zeros(4, requires_grad=True)
    assert topk_sample(logits, 4, 1.0, torch.zeros(4)).equal(torch.ones(4))
    with pytest.raises(ValueError, match="keep 1 to 4"):
        topk_sample(logits, 0, 1.0, torch.zeros(4))


def test_topk_of_one_with_gumbel_noise_draws_from_the_softmax():
    """Kept = 1 is the Gumbel-max trick: the keep frequencies are softmax(logits) (another noise
    — logistic, negated Gumbel — or no noise draws from another distribution)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([1.0, 0.0, -1.0, 0.5])
    draws = 6000
    counts = torch.zeros(4)
    for _ in range(draws):
        counts += topk_sample(logits, 1, 1.0, gumbel_noise((4,), generator=g))
    torch.testing.assert_close(counts / draws, torch.softmax(logits, 0), rtol=0, atol=0.02)


def test_gumbel_noise_has_the_gumbel_mean_and_variance():
    noise = gumbel_noise((200_000,), generator=torch.Generator().manual_seed(1))
    assert abs(float(noise.mean()) - 0.5772) < 0.01  # Euler-Mascheroni
    assert abs(float(noise.var()) - torch.pi**2 / 6) < 0.03


def test_the_sampler_drops_exactly_the_budgets_blocks_every_forward_and_bernoulli_does_not():
    """At 2/3 of a 6-block decoder, every topk training forward gates exactly 2 blocks to 0
    (the extraction's depth) and the block logits get a gradient; the Bernoulli sampler's
    counts vary (what topk is for)."""
    counts = {}
    for mode in ("topk", "bernoulli"):
        model = make_tiny_model("llama", num_layers=6)
        logits = {"layers": torch.zeros(6)}
        sampler = StructureSampler(model, ("layers",), logits, 2 / 3, layer_sample=mode)
        assert sampler.removal()["layers"] == 2
        torch.manual_seed(0)
        counts[mode] = []
        for _ in range(12):
            model(DATA[:1]).logits.sum().backward()
            gate = sampler.gates.values["layers"]
            counts[mode].append(int((gate[:, 0] == 0).sum()))
        assert gate[:, 0].equal(gate[:, 1])  # attention and MLP of a block go together
        assert sampler.logits["layers"].grad.abs().sum() > 0
        sampler.remove()
    assert set(counts["topk"]) == {2}
    assert len(set(counts["bernoulli"])) > 1


def test_topk_layers_end_to_end_extracts_the_budgets_depth():
    model = make_tiny_model("llama", num_layers=5)
    config = SubnetConfig(
        structure=("layers",), sparsity=0.4, steps=4, prior="none", layer_sample="topk",
        constraint="none", optimizer="adamw", lr=0.05,
    )  # fmt: skip
    report = compress(model, config, DATA)
    assert len(block_shapes(model)) == 3 and model.config.num_hidden_layers == 3
    assert abs(report.extra["kept_fraction"] - 0.6) < 1e-6


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"structure": ("channels",), "layer_sample": "topk"}, "add --structure layers"),
        ({"layer_sample": "topk"}, "add --structure"),
    ],
)
def test_layer_sample_needs_layers(options, message):
    with pytest.raises(ConfigError, match=message):
        SubnetConfig(sparsity=0.2, **options)
