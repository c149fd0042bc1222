"""Subnetwork extraction with MaskLLM's schedules: τ annealed from ``tau`` to ``tau_end`` and
κ, the scale of the N:M pattern logits, linear from ``kappa[0]`` to ``kappa[1]``."""

import pytest
import torch

from lmcompress import compress
from lmcompress.compressor.config import Sparsity
from lmcompress.compressor.model.surgery import LayerSelection, weight_matrix
from lmcompress.compressor.training.gumbel import candidate_patterns, gumbel_noise
from lmcompress.errors import ConfigError
from lmcompress.methods.subnet import SubnetConfig
from lmcompress.methods.subnet.learning import schedules
from lmcompress.methods.subnet.parametrization import KeepLogitMask
from lmcompress.methods.subnet.sampling import nm_sample


@pytest.mark.parametrize(("tau", "kappa"), [(0.5, 1.0), (2.0, 1.0), (1.0, 0.5), (0.3, 0.4)])
def test_soft_nm_sample_is_the_tempered_pattern_softmax(tau, kappa):
    """The relaxed N:M sample (hard=False) is Σ_c softmax_c((κ·s_c + g_c) / τ) · c over the
    patterns c, s_c the sum of the group's logits c keeps; every pattern written out with
    itertools (κ < 1 flattens the distribution as κ > 1 sharpens it)."""
    import itertools

    logits = torch.tensor([[0.9, -0.3, 0.2, -1.1, 0.5, 0.4, -0.7, 1.3]])  # two groups of 4
    patterns = [
        [float(j in kept) for j in range(4)] for kept in itertools.combinations(range(4), 2)
    ]
    candidates = torch.tensor(patterns)
    noise = gumbel_noise((2, 6), generator=torch.Generator().manual_seed(0))
    expected = []
    for group, g in zip(logits.reshape(2, 4), noise, strict=True):
        pairs = zip(candidates, g, strict=True)
        scores = [(kappa * float(group @ c) + float(gc)) / tau for c, gc in pairs]
        weights = torch.softmax(torch.tensor(scores), 0)
        expected.append(sum(w * c for w, c in zip(weights, candidates, strict=True)))
    sample = nm_sample(logits, candidates, tau, noise, hard=False, kappa=kappa)
    torch.testing.assert_close(sample, torch.cat(expected)[None], rtol=1e-5, atol=1e-6)


def test_kappa_sharpens_the_pattern_distribution_to_exp_of_kappa_times_the_sum():
    """With κ, pattern c has probability ∝ exp(κ Σ_{j∈c} logit_j): at κ = 3 the most probable
    pattern's frequency is that of the κ-scaled softmax, not of κ = 1."""
    torch.manual_seed(0)
    logits = torch.tensor([0.6, -0.2, 0.1, -0.4])
    candidates = candidate_patterns(2, 4)
    draws = 20000
    rows = logits.expand(draws, -1).contiguous()
    noise = gumbel_noise((draws, len(candidates)))
    masks = nm_sample(rows, candidates, 1.0, noise, kappa=3.0).detach()
    index = (masks @ (2 ** torch.arange(4.0))).long()
    codes = (candidates @ (2 ** torch.arange(4.0))).long()
    freq = torch.stack([(index == c).float().mean() for c in codes])
    p = torch.softmax(3.0 * (candidates @ logits), 0)
    assert torch.all((freq - p).abs() < 4.5 * (p * (1 - p) / draws).sqrt()), (freq, p)
    unscaled = torch.softmax(candidates @ logits, 0)
    assert freq.max() > unscaled.max() + 0.1


def test_kappa_scales_the_gradient_of_the_relaxed_sample():
    logits = torch.randn(4, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    candidates = candidate_patterns(2, 4)
    noise = torch.zeros(8, len(candidates))
    weight = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))

    def grad(kappa: float, scaled_logits: float = 1.0) -> torch.Tensor:
        sample = nm_sample(logits * scaled_logits, candidates, 0.5, noise, False, kappa)
        return torch.autograd.grad((sample * weight).sum(), logits)[0]

    assert torch.allclose(grad(2.5), grad(1.0, 2.5), atol=1e-6)
    assert not torch.allclose(grad(2.5), grad(1.0), atol=1e-3)


def _masks(nm: bool) -> dict[str, KeepLogitMask]:
    target = Sparsity(n=2, m=4) if nm else Sparsity(ratio=0.5)
    return {f"l{i}": KeepLogitMask(torch.zeros(4, 8), target) for i in range(2)}


def test_schedules_are_linear_from_start_to_end_on_every_mask():
    config = SubnetConfig(sparsity="2:4", tau=4.0, tau_end=0.05, kappa=(100.0, 500.0))
    masks = _masks(nm=True)
    before_step = schedules(config, masks, steps=10)
    for step, tau, kappa in [(0, 4.0, 100.0), (5, 2.025, 300.0), (10, 0.05, 500.0)]:
        logs = before_step(step)
        assert logs == pytest.approx({"tau": tau, "kappa": kappa})
        assert all(m.tau == pytest.approx(tau) and m.kappa == pytest.approx(kappa)
                   for m in masks.values())  # fmt: skip


def test_no_schedule_without_tau_end_or_kappa():
    assert schedules(SubnetConfig(sparsity="2:4"), _masks(nm=True), steps=10) is None
    tau_only = schedules(SubnetConfig(sparsity=0.5, tau=2.0, tau_end=0.5), _masks(False), 4)
    assert tau_only(4) == {"tau": 0.5, "kappa": 1.0}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"sparsity": 0.5, "kappa": (1.0, 5.0)}, "needs an N:M sparsity"),
        ({"sparsity": "2:4", "tau_end": 0.0}, "positive"),
        ({"sparsity": "2:4", "kappa": (0.0, 5.0)}, "positive"),
    ],
)
def test_bad_schedules(options, message):
    with pytest.raises(ConfigError, match=message):
        SubnetConfig(**options)


@pytest.mark.parametrize("blockwise", [False, True])
def test_a_scheduled_nm_run_logs_the_schedule_and_ends_exactly_nm(blockwise):
    from conftest import make_tiny_model

    config = SubnetConfig(
        sparsity="2:4", steps=4, batch_size=2, tau=4.0, tau_end=0.05, kappa=(1.0, 5.0),
        blockwise=blockwise,
    )  # fmt: skip
    model = make_tiny_model("llama")
    data = torch.randint(3, 256, (12, 32), generator=torch.Generator().manual_seed(0))
    _, stats = compress(model, config, data, return_stats=True)
    for name, module in LayerSelection().select(model).items():
        keep = weight_matrix(module) != 0
        assert torch.all(keep.reshape(-1, 4).sum(1) == 2), name
    if not blockwise:
        history = stats.meta["history"]
        assert [h["tau"] for h in history] == pytest.approx([4.0, 3.0125, 2.025, 1.0375])
        assert [h["kappa"] for h in history] == pytest.approx([1.0, 2.0, 3.0, 4.0])


def test_the_layer_mask_samples_with_its_kappa():
    """A large κ on the layer's parametrization: every sample is the extracted pattern (at
    κ = 1 the logits below leave other patterns likely)."""
    torch.manual_seed(0)
    logits = torch.tensor([[0.4, -0.1, 0.2, -0.3] * 2] * 64)
    mask = KeepLogitMask(logits.clone(), Sparsity(n=2, m=4), scale="none")
    unsharpened = mask.mask().detach()
    mask.kappa = 200.0
    sharpened = mask.mask().detach()
    assert torch.equal(sharpened.bool(), mask.keep())
    assert not torch.equal(unsharpened.bool(), mask.keep())
