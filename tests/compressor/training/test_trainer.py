"""The shared trainer: any sequence of examples, exact resume, the data split between
processes, requires_grad flags given back, and options derived from TrainingOptions."""

import dataclasses
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from lmcompress.compressor.training.options import TrainingOptions, trainable_only
from lmcompress.compressor.training.trainer import TrainConfig, Trainer, batch_indices
from lmcompress.errors import ConfigError, LmcompressError
from lmcompress.methods.maskllm.config import MaskLLMConfig


class Toy(nn.Module):
    """y = scale · (w · x): ``scale`` is trained; ``w`` trainable but not trained here; ``b``
    frozen from the start."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randn(4, generator=generator))
        self.b = nn.Parameter(torch.randn(4, generator=generator), requires_grad=False)
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * (self.w * x) + self.b


def _examples(n=10):
    """Not token ids: dicts of inputs and targets (what a block-wise loss gets)."""
    generator = torch.Generator().manual_seed(1)
    xs = torch.randn(n, 4, generator=generator)
    return [{"x": x, "y": 3 * x} for x in xs]


def _loss(model, batch, _step):
    x = torch.stack([e["x"] for e in batch])  # (b, 4)
    y = torch.stack([e["y"] for e in batch])
    loss = (model(x) - (y * model.w.detach() + model.b)).square().mean()
    return loss, {"mse": float(loss.detach())}


def _trainer(model, steps=6, **kwargs):
    config = TrainConfig(steps=steps, lr=0.3, batch_size=2, grad_accum=2, weight_decay=0.0)
    return Trainer(model, {"scale": model.scale}, config, _loss, leave=False, **kwargs)


def test_trains_on_a_sequence_of_arbitrary_examples():
    model = Toy()
    state = _trainer(model, steps=40).fit(_examples())
    losses = [h["mse"] for h in state.history]
    assert len(losses) == 40 and sum(losses[-5:]) < 0.05 * sum(losses[:5])
    assert [h["step"] for h in state.history] == list(range(1, 41))
    assert torch.allclose(model.scale, torch.full((4,), 3.0), atol=0.3)


def test_an_iterable_is_read_once_and_trains_like_its_list():
    a, b = Toy(), Toy()
    _trainer(a).fit(_examples())
    _trainer(b).fit(iter(_examples()))
    assert torch.equal(a.scale, b.scale)


def test_only_the_trained_parameters_require_grad_and_every_flag_comes_back():
    model = Toy()
    seen = []

    def loss_fn(model, batch, step):
        seen.append({n: p.requires_grad for n, p in model.named_parameters()})
        return _loss(model, batch, step)

    config = TrainConfig(steps=2, batch_size=2)
    Trainer(model, {"scale": model.scale}, config, loss_fn, leave=False).fit(_examples())
    assert seen and all(s == {"w": False, "b": False, "scale": True} for s in seen)
    assert {n: p.requires_grad for n, p in model.named_parameters()} == {
        "w": True,
        "b": False,  # frozen before: frozen after
        "scale": True,
    }


def test_flags_come_back_after_an_error():
    model = Toy()
    model.scale.requires_grad_(False)  # not trainable before: given back as it was

    def failing(model, batch, step):
        if step == 1:
            raise RuntimeError("boom")
        return _loss(model, batch, step)

    trainer = Trainer(model, {"scale": model.scale}, TrainConfig(steps=3), failing, leave=False)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(_examples())
    assert trainer.state.step == 1
    assert {n: p.requires_grad for n, p in model.named_parameters()} == {
        "w": True,
        "b": False,
        "scale": False,
    }


def test_trainable_only_covers_parameters_outside_the_model():
    model, extra = Toy(), nn.Parameter(torch.zeros(2), requires_grad=False)
    with trainable_only(model, [extra]):
        assert extra.requires_grad and not model.w.requires_grad
    assert not extra.requires_grad and model.w.requires_grad


def test_killed_run_resumes_to_exactly_the_uninterrupted_result(tmp_path):
    config = TrainConfig(steps=6, lr=0.3, batch_size=3, checkpoint_every=3, seed=2)

    def run(stop_after=None, resume=False, checkpoint_dir=tmp_path):
        model = Toy()
        trainer = Trainer(
            model, {"scale": model.scale}, config, _loss, checkpoint_dir=checkpoint_dir
        )
        return model, trainer.fit(_examples(), resume=resume, stop_after=stop_after)

    straight, _ = run(checkpoint_dir=None)
    killed, _ = run(stop_after=4)  # the checkpoint of step 3 is the last one written
    resumed, state = run(resume=True)
    assert [h["step"] for h in state.history] == [1, 2, 3, 4, 5, 6]
    assert torch.equal(resumed.scale, straight.scale)
    assert not torch.equal(killed.scale, straight.scale)


def _interrupted(tmp_path, config, fingerprint=None, stop_after=2):
    """A run killed after ``stop_after`` steps (its checkpoints in ``tmp_path``)."""
    model = Toy()
    Trainer(
        model, {"scale": model.scale}, config, _loss, checkpoint_dir=tmp_path, leave=False,
        fingerprint=fingerprint,
    ).fit(_examples(), stop_after=stop_after)  # fmt: skip


def _resume(tmp_path, config, params=None, fingerprint=None, data=None):
    model = Toy()
    trainer = Trainer(
        model, params or {"scale": model.scale}, config, _loss, checkpoint_dir=tmp_path,
        leave=False, fingerprint=fingerprint,
    )  # fmt: skip
    return model, trainer.fit(_examples() if data is None else data, resume=True)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"lr": 1e-3}, "lr: 0.0002 → 0.001"),
        ({"lr": 1e-3, "steps": 5}, "steps: 4 → 5; lr: 0.0002 → 0.001"),
        ({"betas": (0.8, 0.95)}, "betas: [0.9, 0.95] → [0.8, 0.95]"),
        ({"fingerprint": {"sparsity": "4:8", "prior": "none"}}, "sparsity: 2:4 → 4:8; prior"),
        ({"fingerprint": {}}, "sparsity: 2:4 → (absent)"),
        ({"data": _examples(12)}, "training data: 10 examples → 12 examples"),
    ],
)
def test_resume_under_other_options_names_each_difference(tmp_path, change, message):
    config = TrainConfig(steps=4, batch_size=2, checkpoint_every=2)
    _interrupted(tmp_path, config, fingerprint={"sparsity": "2:4", "prior": "magnitude"})
    change = dict(change)
    fingerprint = change.pop("fingerprint", {"sparsity": "2:4", "prior": "magnitude"})
    data = change.pop("data", None)
    other = dataclasses.replace(config, **change)
    with pytest.raises(ConfigError) as err:
        _resume(tmp_path, other, fingerprint=fingerprint, data=data)
    text = str(err.value)
    assert "\n" not in text and message in text, text
    assert text.startswith(f"checkpoint {tmp_path / 'trainer_state'} was written with other opt")
    assert text.endswith("rerun without --resume or with the same options")


def test_resume_with_other_parameter_shapes_is_one_line(tmp_path):
    config = TrainConfig(steps=4, batch_size=2, checkpoint_every=2)
    _interrupted(tmp_path, config)
    params = {"scale": nn.Parameter(torch.ones(2)), "extra": nn.Parameter(torch.ones(1))}
    with pytest.raises(ConfigError, match=r"holds other parameters \(scale: \[4\] → \[2\]; "
                       r"extra: \(absent\) → \[1\]\)"):  # fmt: skip
        _resume(tmp_path, config, params=params)
    assert torch.equal(params["scale"], torch.ones(2))  # nothing was copied


@pytest.mark.parametrize(
    ("change", "value"),
    [("checkpoint_every", 3), ("checkpoint_every", 0), ("eval_every", 1), ("mmap_threshold", 0)],
)
def test_bookkeeping_options_do_not_block_a_resume(tmp_path, change, value):
    """Checkpoint and evaluation intervals, the mmap threshold: a resume may change them and
    ends exactly where the uninterrupted run does."""
    config = TrainConfig(steps=6, lr=0.3, batch_size=3, checkpoint_every=2, mmap_threshold=1 << 20)
    straight = Toy()
    Trainer(straight, {"scale": straight.scale}, config, _loss, leave=False).fit(_examples())
    _interrupted(tmp_path, config, stop_after=3)  # the checkpoint of step 2 is the last one
    other = dataclasses.replace(config, **{change: value})
    assert getattr(other, change) == value and other != config
    resumed, state = _resume(tmp_path, other)
    assert [h["step"] for h in state.history] == [1, 2, 3, 4, 5, 6]
    assert torch.equal(resumed.scale, straight.scale)


def _truncate(path):
    path.write_bytes(path.read_bytes()[:-20])


def _rewrite_json(path, edit):
    meta = json.loads(path.read_text())
    edit(meta)
    path.write_text(json.dumps(meta))


CORRUPTIONS = {
    "truncated tensors": ("state.safetensors", _truncate, "incomplete metadata"),
    "tensors not safetensors": (
        "state.safetensors",
        lambda p: p.write_bytes(b"garbage"),
        "header",
    ),
    "tensors missing": ("state.safetensors", lambda p: p.unlink(), "No such file"),
    "json garbage": ("state.json", lambda p: p.write_text("{not json"), "not valid JSON"),
    "json not an object": ("state.json", lambda p: p.write_text("[1]"), "not a JSON object"),
    "json missing": ("state.json", lambda p: p.unlink(), "missing"),
    "json without params": (
        "state.json",
        lambda p: _rewrite_json(p, lambda m: m.pop("params")),
        "no params",
    ),
    "json with a bad state": (
        "state.json",
        lambda p: _rewrite_json(p, lambda m: m["state"].update(step="two")),
        "malformed state",
    ),
    "json with an unknown state key": (
        "state.json",
        lambda p: _rewrite_json(p, lambda m: m["state"].update(epoch=1)),
        "unexpected keyword",
    ),
    "a tensor shaped unlike the json": (
        "state.safetensors",
        lambda p: save_file({"param.scale": torch.ones(2), "rng.torch": torch.get_rng_state()}, p),
        "param.scale is [2], state.json says [4]",
    ),
    "tensors without the rng": (
        "state.safetensors",
        lambda p: save_file({"param.scale": torch.ones(4)}, p),
        "no rng.torch",
    ),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_a_corrupt_checkpoint_is_one_line_naming_the_file(tmp_path, case):
    name, corrupt, reason = CORRUPTIONS[case]
    config = TrainConfig(steps=4, batch_size=2, checkpoint_every=2)
    _interrupted(tmp_path, config)
    path = tmp_path / "trainer_state" / name
    corrupt(path)
    model = Toy()
    with pytest.raises(LmcompressError) as err:
        Trainer(model, {"scale": model.scale}, config, _loss, checkpoint_dir=tmp_path).fit(
            _examples(), resume=True
        )
    text = str(err.value)
    assert "\n" not in text and reason in text, text
    assert text.startswith(f"checkpoint {path} is corrupt or incomplete ("), text
    assert text.endswith("delete it or rerun without --resume"), text
    assert torch.equal(model.scale, torch.ones(4))  # nothing was copied


def test_the_last_checkpoint_keeps_no_optimiser_moments(tmp_path):
    config = TrainConfig(steps=4, batch_size=2, checkpoint_every=2)
    _interrupted(tmp_path, config, stop_after=3)
    keys = safe_open(str(tmp_path / "trainer_state" / "state.safetensors"), "pt").keys()
    assert any(k.startswith("opt.scale.") for k in keys)  # step 2 of 4: AdamW's moments
    _interrupted(tmp_path, config, stop_after=4)
    keys = safe_open(str(tmp_path / "trainer_state" / "state.safetensors"), "pt").keys()
    assert sorted(keys) == ["param.scale", "rng.torch"]
    straight = Toy()
    Trainer(straight, {"scale": straight.scale}, config, _loss, leave=False).fit(_examples())
    resumed, state = _resume(tmp_path, config)  # nothing left to train: the saved result
    assert state.step == 4 and len(state.history) == 4
    assert torch.equal(resumed.scale, straight.scale)


class _FakeAccelerator:
    """Two processes as the trainer sees them (no process group: gradients stay local)."""

    def __init__(self, rank: int) -> None:
        self.num_processes, self.process_index = 2, rank
        self.is_main_process = rank == 0

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()


def test_tensor_batches_are_split_between_processes():
    data = torch.arange(40).reshape(10, 4)
    config = TrainConfig(steps=3, batch_size=4, seed=5)
    seen = {0: [], 1: []}

    def loss_fn(model, ids, _step):
        seen[rank].append(ids.clone())
        return (model.scale.sum() * 0 + ids.float().mean() * model.scale.sum()), {}

    for rank in (0, 1):
        model = Toy()
        Trainer(
            model, {"scale": model.scale}, config, loss_fn, accelerator=_FakeAccelerator(rank)
        ).fit(data)
    for step in range(3):
        whole = data[batch_indices(step, 0, config, len(data))]  # (4, 4): the step's batch
        assert torch.equal(seen[0][step], whole[0::2]) and torch.equal(seen[1][step], whole[1::2])


def test_data_order_is_a_function_of_the_step():
    config = TrainConfig(batch_size=3, grad_accum=2, seed=7)
    a = [batch_indices(s, m, config, 10) for s in range(8) for m in range(2)]
    b = [batch_indices(s, m, config, 10) for s in reversed(range(8)) for m in range(2)]
    assert all(torch.equal(x, y) for x, y in zip(a, reversed_pairs(b), strict=True))
    epoch = torch.cat(a)[:10]  # the first epoch visits every example once
    assert sorted(epoch.tolist()) == list(range(10))


def reversed_pairs(items):
    pairs = [items[i : i + 2] for i in range(0, len(items), 2)]
    return [x for pair in reversed(pairs) for x in pair]


def test_train_config_is_derived_from_the_options():
    options = TrainingOptions(steps=7, lr=1e-3, batch_size=3, grad_accum=2, train_seed=11)
    config = TrainConfig.from_options(options, mmap_threshold=1 << 20)
    assert (config.steps, config.lr, config.batch_size, config.grad_accum) == (7, 1e-3, 3, 2)
    assert config.seed == 11 and config.mmap_threshold == 1 << 20
    assert TrainConfig.from_options(options, seed=12).seed == 12


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"steps": 0}, "steps must be"),
        ({"lr": 0.0}, "lr must be"),
        ({"eval_windows": -1}, "eval_windows"),
        ({"resume": True}, "checkpoint-dir"),
    ],
)
def test_bad_training_options(options, message):
    with pytest.raises(ConfigError, match=message):
        TrainingOptions(**options)


def test_a_learned_method_takes_its_training_options_flat_or_nested():
    flat = MaskLLMConfig(steps=3, lr=0.01, prior="magnitude")
    nested = MaskLLMConfig(training=TrainingOptions(steps=3, lr=0.01), prior="magnitude")
    assert flat == nested and flat.training.steps == 3
    assert dataclasses.replace(flat, steps=5).training == TrainingOptions(steps=5, lr=0.01)
    assert MaskLLMConfig(training=TrainingOptions(steps=3), lr=0.5).training.steps == 3
    recipe = flat.to_dict()
    assert recipe["steps"] == 3 and "training" not in recipe
    assert MaskLLMConfig.from_dict(recipe) == flat


def test_sgd_with_per_parameter_learning_rates_steps_as_written():
    """Two parameters, SGD with momentum, constant schedule, one with its own lr: two steps
    match the update rule by hand (v ← μv + g, p ← p − lr·v), no clipping (grad_clip 0)."""
    model = Toy()
    params = {"scale": model.scale, "w": model.w}
    config = TrainConfig(
        steps=2, lr=0.5, batch_size=10, optimizer="sgd", momentum=0.9, schedule="constant",
        weight_decay=0.0, grad_clip=0.0,
    )  # fmt: skip
    examples = _examples()

    def loss_fn(model, batch, _step):
        x = torch.stack([e["x"] for e in batch])
        return model(x).square().sum(), {}

    expected = {k: v.detach().clone() for k, v in params.items()}
    velocity = {k: torch.zeros_like(v) for k, v in expected.items()}
    lrs = {"scale": 0.5, "w": 0.01}
    x = torch.stack([e["x"] for e in examples])  # batch_size 10 = every example, any order
    for _ in range(2):
        s, w = expected["scale"].requires_grad_(), expected["w"].requires_grad_()
        grads = torch.autograd.grad((s * (w * x) + model.b).square().sum(), [s, w])
        with torch.no_grad():
            for (name, value), grad in zip(list(expected.items()), grads, strict=True):
                velocity[name] = 0.9 * velocity[name] + grad
                expected[name] = (value - lrs[name] * velocity[name]).detach()
    Trainer(model, params, config, loss_fn, leave=False, param_options={"w": {"lr": 0.01}}).fit(
        examples
    )
    for name, param in params.items():
        assert torch.allclose(param, expected[name], atol=1e-5), name


def test_unknown_optimizer_or_parameter_options_are_refused():
    with pytest.raises(ConfigError, match="optimizer"):
        TrainConfig(optimizer="lion")
    model = Toy()
    with pytest.raises(ValueError, match="unknown parameters"):
        Trainer(model, {"scale": model.scale}, TrainConfig(), _loss, param_options={"w": {}})
