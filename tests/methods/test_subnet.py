"""Stochastic subnetwork extraction (ASLP): the sampler's statistics, straight-through
gradients, exact sparsity, extraction = the parametrized model in hard mode, resume, export."""

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lmcompress import compress, load_compressed, save_compressed
from lmcompress.compressor.config import Sparsity
from lmcompress.compressor.model.surgery import LayerSelection, add_parametrization, weight_matrix
from lmcompress.compressor.training.gumbel import candidate_patterns, gumbel_noise
from lmcompress.compressor.training.trainer import Trainer
from lmcompress.errors import ConfigError
from lmcompress.methods.subnet import SubnetConfig
from lmcompress.methods.subnet.learning import KeepRateConstraint, new_mask
from lmcompress.methods.subnet.parametrization import KeepLogitMask
from lmcompress.methods.subnet.sampling import (
    extract_keep,
    keep_sample,
    logistic_noise,
    nm_sample,
)


def _data():
    return torch.randint(3, 256, (12, 32), generator=torch.Generator().manual_seed(0))


def _run(config, model_type="llama"):
    from conftest import make_tiny_model

    model = make_tiny_model(model_type)
    report, stats = compress(model, config, _data(), return_stats=True)
    return model, report, stats


def _masks(model):
    return {n: weight_matrix(m) != 0 for n, m in LayerSelection().select(model).items()}


def test_keep_frequencies_match_the_probabilities():
    torch.manual_seed(0)
    logits = torch.linspace(-3, 3, 13)
    draws = 20000
    samples = keep_sample(
        logits.expand(draws, -1), 1.0, logistic_noise((draws, 13)), hard=True
    ).detach()
    freq, p = samples.mean(0), torch.sigmoid(logits)
    sigma = (p * (1 - p) / draws).sqrt()
    assert torch.all((freq - p).abs() < 4.5 * sigma), (freq, p)


def test_nm_pattern_frequencies_match_the_conditional_bernoulli():
    """Given exactly n of m kept, pattern c has probability ∝ exp(Σ_{j∈c} logit_j)."""
    torch.manual_seed(0)
    logits = torch.tensor([1.5, -0.5, 0.3, -1.0])
    candidates = candidate_patterns(2, 4)
    draws = 20000
    rows = logits.expand(draws, -1).contiguous()
    masks = nm_sample(rows, candidates, 1.0, gumbel_noise((draws, len(candidates)))).detach()
    index = (masks @ (2 ** torch.arange(4.0))).long()  # the pattern as a bit code
    codes = (candidates @ (2 ** torch.arange(4.0))).long()
    freq = torch.stack([(index == c).float().mean() for c in codes])
    p = torch.softmax(candidates @ logits, 0)
    assert torch.all((freq - p).abs() < 4.5 * (p * (1 - p) / draws).sqrt()), (freq, p)
    assert torch.all(masks.sum(1) == 2)


def test_binary_concrete_is_the_gumbel_softmax_of_the_logit_and_zero():
    torch.manual_seed(0)
    m, g = torch.randn(50), gumbel_noise((2, 50))
    reference = F.softmax(torch.stack([m + g[0], g[1]]) / 0.7, dim=0)[0]
    assert torch.allclose(keep_sample(m, 0.7, g[0] - g[1], hard=False), reference, atol=1e-6)


@pytest.mark.parametrize("nm", [False, True])
def test_hard_sample_is_binary_and_its_gradient_is_the_soft_one(nm):
    torch.manual_seed(0)
    logits = torch.randn(8, 8, requires_grad=True)
    weight = torch.randn(8, 8)
    if nm:
        candidates = candidate_patterns(2, 4)
        noise = gumbel_noise((16, len(candidates)))
        sample = lambda hard: nm_sample(logits, candidates, 0.5, noise, hard=hard)  # noqa: E731
    else:
        noise = logistic_noise((8, 8))
        sample = lambda hard: keep_sample(logits, 0.5, noise, hard=hard)  # noqa: E731
    hard = sample(True)
    assert set(hard.detach().unique().tolist()) <= {0.0, 1.0}
    (grad_hard,) = torch.autograd.grad((hard * weight).sum(), logits)
    (grad_soft,) = torch.autograd.grad((sample(False) * weight).sum(), logits)
    assert torch.equal(grad_hard, grad_soft) and grad_hard.abs().sum() > 0


def test_topk_extraction_keeps_exactly_the_target():
    logits = torch.randn(7, 13, generator=torch.Generator().manual_seed(0))
    assert int(extract_keep(logits, Sparsity(ratio=0.3)).sum()) == 91 - round(0.3 * 91)
    assert torch.equal(extract_keep(logits, None), logits >= 0)
    keep = extract_keep(torch.randn(4, 8), Sparsity(n=2, m=4))
    assert torch.all(keep.reshape(-1, 4).sum(1) == 2)


@pytest.mark.parametrize(("sparsity", "model_type"), [("0.5", "llama"), ("0.3", "gpt2")])
def test_achieved_sparsity_equals_the_target(sparsity, model_type):
    config = SubnetConfig(sparsity=sparsity, steps=4, batch_size=2, prior="magnitude")
    model, report, _ = _run(config, model_type)
    for name, keep in _masks(model).items():
        expected = keep.numel() - round(float(sparsity) * keep.numel())
        assert int(keep.sum()) == expected, name
    assert report.extra["sparsity"] == pytest.approx(float(sparsity), abs=1e-3)


def test_nm_target_trains_and_ends_exactly_nm():
    config = SubnetConfig(sparsity="2:4", steps=4, batch_size=2, optimizer="adamw", lr=0.05)
    model, report, stats = _run(config)
    for name, keep in _masks(model).items():
        assert torch.all(keep.reshape(-1, 4).sum(1) == 2), name
    assert len(report.extra["loss_curve"]) == 4
    assert all(p.requires_grad for p in model.parameters())  # unfrozen again afterwards
    assert any(k.endswith(".scale") for k in stats.tensors)


@pytest.mark.parametrize("scale", ["layer", "row"])
def test_extraction_with_the_scale_folded_in_is_the_hard_parametrized_model(scale):
    from conftest import make_tiny_model

    model, ids = make_tiny_model("gpt2"), _data()[:2]
    config = SubnetConfig(sparsity="0.5", scale=scale)
    layers = LayerSelection().select(model)
    generator = torch.Generator().manual_seed(0)
    masks = {n: new_mask(config, n, m, None) for n, m in layers.items()}
    with torch.no_grad():
        for mask in masks.values():
            mask.logits.normal_(generator=generator)
            mask.scale.uniform_(0.5, 1.5, generator=generator)
            mask.hard = True
    with torch.no_grad():
        parametrized = model(ids).logits
    from lmcompress.methods.subnet.learning import extract_layer

    for name, module in layers.items():
        extract_layer(config, name, module, masks[name].logits.detach(), masks[name].scale.data)
    with torch.no_grad():
        extracted = model(ids).logits
    assert torch.allclose(parametrized, extracted, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["penalty", "lagrangian"])
def test_the_keep_rate_constraint_by_hand(kind):
    """Keep logits all 1 against a target keep rate k = 0.5: r = sigmoid(1), d = (r − k) / k.
    penalty: w · d²; lagrangian: λ1 d + λ2 d², whose multipliers get the reversed gradient
    (−d, −d²), so that descent on the loss raises them while the rate is above target."""
    layer = torch.nn.Linear(8, 8)
    config = SubnetConfig(sparsity="0.5", constraint=kind, constraint_weight=3.0)
    mask = KeepLogitMask(torch.full((8, 8), 1.0), Sparsity(ratio=0.5))
    add_parametrization(layer, mask)
    constraint = KeepRateConstraint(config, {"layer": mask})
    d = (1 / (1 + math.exp(-1)) - 0.5) / 0.5  # 0.4621...
    if kind == "lagrangian":
        with torch.no_grad():
            constraint.multipliers.copy_(torch.tensor([[2.0], [5.0]]))  # (λ1, λ2) of one layer
    term, logs = constraint(0)
    expected = 3.0 * d**2 if kind == "penalty" else 2.0 * d + 5.0 * d**2
    assert term.item() == pytest.approx(expected, rel=1e-6)
    assert logs["keep_dev"] == pytest.approx(d, rel=1e-6)
    term.backward()
    # dterm/dlogit_ij = dterm/dd · sigmoid'(1) / (k · 64), the same for every logit
    slope = 6.0 * d if kind == "penalty" else 2.0 + 10.0 * d
    sigmoid_slope = math.exp(-1) / (1 + math.exp(-1)) ** 2
    torch.testing.assert_close(
        mask.logits.grad, torch.full((8, 8), slope * sigmoid_slope / (0.5 * 64)), rtol=1e-5, atol=0
    )
    if kind == "lagrangian":
        assert logs["lambda"] == 5.0
        torch.testing.assert_close(constraint.multipliers.grad, torch.tensor([[-d], [-(d**2)]]))


@pytest.mark.parametrize("scale", ["relative", "size"])
def test_the_size_scaled_constraint_pulls_every_layers_logits_alike(scale):
    """Two layers of 64 and 256 logits, all 1, target k = 0.5, λ1 = 1: relative pulls a logit
    of the small layer 4x harder (∝ 1 / (k · N)); size multiplies d_l by N_l / mean N (0.4 and
    1.6), so both pull sigmoid'(1) / (k · 160) per logit, and keep_dev stays the relative one."""
    config = SubnetConfig(sparsity="0.5", constraint="lagrangian", constraint_scale=scale)
    masks = {}
    for name, width in (("small", 8), ("large", 32)):
        layer = torch.nn.Linear(width, 8)
        masks[name] = KeepLogitMask(torch.full((8, width), 1.0), Sparsity(ratio=0.5))
        add_parametrization(layer, masks[name])
    constraint = KeepRateConstraint(config, masks)
    with torch.no_grad():
        constraint.multipliers.copy_(torch.tensor([[1.0, 1.0], [0.0, 0.0]]))
    term, logs = constraint(0)
    term.backward()
    d = (1 / (1 + math.exp(-1)) - 0.5) / 0.5
    assert logs["keep_dev"] == pytest.approx(d, rel=1e-6)
    sigmoid_slope = math.exp(-1) / (1 + math.exp(-1)) ** 2
    for name, size in (("small", 64), ("large", 256)):
        per_logit = sigmoid_slope / (0.5 * (160 if scale == "size" else size))
        torch.testing.assert_close(
            masks[name].logits.grad,
            torch.full_like(masks[name].logits, per_logit),
            rtol=1e-5,
            atol=0,
        )


def test_killed_run_resumes_to_the_same_subnetwork(tmp_path, monkeypatch):
    config = dict(sparsity="0.5", steps=6, batch_size=2, prior="magnitude")
    _, _, straight = _run(SubnetConfig(**config))
    original_fit = Trainer.fit

    def killed_fit(self, data, resume=False, stop_after=None):  # noqa: ARG001
        original_fit(self, data, resume=resume, stop_after=4)
        raise KeyboardInterrupt  # the process dies after step 4's checkpoint

    ckpt = str(tmp_path / "ckpt")
    monkeypatch.setattr(Trainer, "fit", killed_fit)
    with pytest.raises(KeyboardInterrupt):
        _run(SubnetConfig(**config, checkpoint_dir=ckpt, checkpoint_every=2))
    monkeypatch.setattr(Trainer, "fit", original_fit)
    _, report, resumed = _run(
        SubnetConfig(**config, checkpoint_dir=ckpt, checkpoint_every=2, resume=True)
    )
    assert straight.tensors.keys() == resumed.tensors.keys()
    for key, value in straight.tensors.items():
        assert torch.equal(resumed.tensors[key], value), key
    assert report.extra["steps"] == 6


@pytest.mark.parametrize("sparsity", ["0.5", "2:4"])
def test_export_round_trip(tmp_path, sparsity):
    from conftest import make_tiny_tokenizer

    config = SubnetConfig(sparsity=sparsity, steps=3, batch_size=2, optimizer="adamw", lr=0.05)
    model, report, stats = _run(config)
    out = save_compressed(
        model, tmp_path / "out", report, tokenizer=make_tiny_tokenizer(), stats=stats
    )
    for runtime in ("packed", "dense"):
        loaded, _, _ = load_compressed(out, runtime=runtime)
        with torch.no_grad():
            a, b = model(_data()[:2]).logits, loaded(_data()[:2]).logits
        assert torch.allclose(a, b, atol=1e-5), runtime


@pytest.mark.parametrize("refit", ["none", "sparsegpt"])
def test_blockwise_lowers_the_block_error_and_hits_the_target(refit):
    config = SubnetConfig(
        sparsity="0.5", steps=12, batch_size=4, blockwise=True, refit=refit,
        optimizer="adamw", lr=0.05, scale="row",
    )  # fmt: skip
    from conftest import make_tiny_model

    dense = dict(LayerSelection().select(make_tiny_model("llama")))
    model, report, stats = _run(config)
    for name, keep in _masks(model).items():
        assert int(keep.sum()) == keep.numel() // 2, name
        kept, original = weight_matrix(dict(LayerSelection().select(model))[name]), dense[name]
        changed = ~torch.isclose(kept[keep], weight_matrix(original)[keep])
        assert changed.any(), name  # re-fitted (OBS updates), or scaled per row
        assert stats.meta["layer_errors"][name] > 0, name
    for block in report.extra["block_curves"]:
        curve = [c["rel_err"] for c in block["curve"]]
        assert min(curve[-3:]) < curve[0], block["block"]
    assert set(stats.meta["layer_errors"]) == set(_masks(model))


@pytest.mark.parametrize("sparsity", ["0.5", "2:4"])
def test_blockwise_weight_tuning_keeps_the_masks_and_lowers_each_block_error(sparsity):
    """Block-wise subnet (the paper's SGD on the logits), then each block's kept weights tuned:
    the extracted masks stay, every block's error falls."""
    config = dict(sparsity=sparsity, steps=4, batch_size=2, blockwise=True, refit="sparsegpt")
    _, _, plain_stats = _run(SubnetConfig(**config))
    tuned, report, stats = _run(SubnetConfig(**config, tune_steps=15, tune_lr=1e-3))
    for key, value in plain_stats.tensors.items():  # block 0 trains the same logits
        if key.startswith("model.layers.0."):
            assert torch.equal(stats.tensors[key], value), key
    for name, keep in _masks(tuned).items():
        assert keep.equal(extract_keep(stats.tensors[f"{name}.logits"], Sparsity.parse(sparsity)))
    for block in report.extra["block_curves"]:
        assert block["tune_after"] < 0.8 * block["tune_before"], block
    assert report.layers[0].params_kept == report.layers[0].params // 2
    assert not any(hasattr(m, "parametrizations") for m in tuned.modules())


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"tune_steps": 5}, "--blockwise"),
        ({"blockwise": True, "tune_lr": 0.0}, "tune_lr"),
        ({"sparsity": "2:4", "extract": "threshold"}, "unstructured"),
        ({"prior": "oracle"}, "prior must be"),
        ({"tau": 0.0}, "positive"),
        ({"scale": "column"}, "scale must be"),
        ({"constraint": "hard"}, "constraint must be"),
        ({"optimizer": "lion"}, "optimizer must be"),
        ({"resume": True}, "checkpoint-dir"),
        ({"blockwise": True, "fsdp": True}, "--fsdp is for end-to-end"),
    ],
)
def test_bad_options(options, message):
    with pytest.raises(ConfigError, match=message):
        SubnetConfig(**options)


def _killed_in_block(monkeypatch, block, step):
    """``Trainer.fit`` that dies in the ``block``-th training (0-based) after ``step`` steps,
    as a killed process would; the trainings before it run whole."""
    original_fit, calls = Trainer.fit, []

    def killed_fit(self, data, resume=False, stop_after=None):  # noqa: ARG001
        calls.append(None)
        if len(calls) <= block:
            return original_fit(self, data, resume=resume)
        original_fit(self, data, resume=resume, stop_after=step)
        raise KeyboardInterrupt

    monkeypatch.setattr(Trainer, "fit", killed_fit)
    return original_fit


@pytest.mark.parametrize(
    ("every", "step", "again", "trained", "saved"),
    [(2, 3, 3, 2, 2), (0, 1, 2, 4, 1)],
)
def test_blockwise_run_killed_mid_block_resumes_bit_for_bit(
    tmp_path, monkeypatch, every, step, again, trained, saved
):
    """Killed in block 1 (of 2) at ``step`` with checkpoints every ``every`` steps (0: only
    each trained block's), then resumed with another interval ``again``: block 0 is replayed
    from its checkpoint, block 1 trains the ``trained`` steps left, and the logits, scales and
    compressed weights are exactly the uninterrupted run's."""
    config = dict(
        sparsity="0.5", steps=4, batch_size=4, blockwise=True, prior="magnitude", scale="row",
        optimizer="adamw", lr=0.05,
    )  # fmt: skip
    straight, straight_report, straight_stats = _run(SubnetConfig(**config))
    ckpt = str(tmp_path / "ckpt")
    original_fit = _killed_in_block(monkeypatch, 1, step)
    with pytest.raises(KeyboardInterrupt):
        _run(SubnetConfig(**config, checkpoint_dir=ckpt, checkpoint_every=every))
    monkeypatch.setattr(Trainer, "fit", original_fit)
    found = sorted(p.relative_to(ckpt).as_posix() for p in Path(ckpt).glob("*/trainer_state"))
    assert found == [f"block-{i:04d}/trainer_state" for i in range(saved)]
    steps, original_step = [], Trainer._step

    def counted_step(self, data):
        steps.append(self.state.step)
        return original_step(self, data)

    monkeypatch.setattr(Trainer, "_step", counted_step)
    resumed, report, stats = _run(
        SubnetConfig(**config, checkpoint_dir=ckpt, checkpoint_every=again, resume=True)
    )
    assert steps == list(range(4 - trained, 4))  # block 1's steps left, block 0's none
    assert straight_stats.tensors.keys() == stats.tensors.keys()
    assert any(k.endswith(".scale") for k in stats.tensors)
    for key, value in straight_stats.tensors.items():
        assert torch.equal(stats.tensors[key], value), key
    expected = straight.state_dict()
    for key, value in resumed.state_dict().items():
        assert torch.equal(value, expected[key]), key
    curves = [[c["loss"] for c in b["curve"]] for b in report.extra["block_curves"]]
    assert curves == [
        [c["loss"] for c in b["curve"]] for b in straight_report.extra["block_curves"]
    ]
    assert [len(c) for c in curves] == [4, 4]


def test_blockwise_resume_under_other_options_is_one_line_before_training(tmp_path, monkeypatch):
    config = dict(sparsity="0.5", steps=2, batch_size=4, blockwise=True, prior="magnitude")
    ckpt = str(tmp_path / "ckpt")
    _run(SubnetConfig(**config, checkpoint_dir=ckpt))  # a finished run: every block saved
    from conftest import make_tiny_model

    same_options = SubnetConfig(**config, checkpoint_dir=ckpt, resume=True)
    digest = "sha256 [0-9a-f]{12}"
    other = rf"training data: 3 examples from 10 examples, {digest} → 2 examples from 6 examples"
    with pytest.raises(ConfigError, match=rf"{other}, {digest}; rerun"):
        compress(make_tiny_model("llama"), same_options, _data()[:8])  # other windows

    def no_training(*_args, **_kwargs):
        raise AssertionError("trained before refusing")

    monkeypatch.setattr(Trainer, "fit", no_training)
    other = SubnetConfig(**{**config, "scale": "row"}, checkpoint_dir=ckpt, resume=True)
    with pytest.raises(ConfigError) as err:
        _run(other)
    text = str(err.value)
    assert "\n" not in text and "scale: layer → row;" in text, text
    assert text.startswith(f"checkpoint {ckpt}/block-0000/trainer_state was written with other")
    end_to_end = SubnetConfig(**{**config, "blockwise": False}, checkpoint_dir=ckpt, resume=True)
    with pytest.raises(ConfigError, match="blockwise: true → false"):
        _run(end_to_end)
