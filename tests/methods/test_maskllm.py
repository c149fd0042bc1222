"""MaskLLM end to end on a tiny model: invariants, prior, resume, export and transfer."""

import pytest
import torch

from lmcompress import MaskLLMConfig, SparseGPTConfig, compress, load_compressed, save_compressed
from lmcompress.compressor.model.surgery import LayerSelection, weight_matrix
from lmcompress.compressor.training.trainer import Trainer
from lmcompress.errors import ConfigError, LmcompressError


def _data():
    return torch.randint(3, 256, (12, 32), generator=torch.Generator().manual_seed(0))


def _masks(model):
    return {n: weight_matrix(m) != 0 for n, m in LayerSelection().select(model).items()}


def _same_masks(a, b):
    masks_a, masks_b = _masks(a), _masks(b)
    return masks_a.keys() == masks_b.keys() and all(
        torch.equal(masks_a[k], masks_b[k]) for k in masks_a
    )


def _run(config, model_type="llama"):
    from conftest import make_tiny_model

    model = make_tiny_model(model_type)
    report, stats = compress(model, config, _data(), return_stats=True)
    return model, report, stats


@pytest.mark.parametrize(("sparsity", "model_type"), [("2:4", "llama"), ("4:8", "gpt2")])
def test_trains_and_ends_exactly_nm(sparsity, model_type):
    n, m = map(int, sparsity.split(":"))
    config = MaskLLMConfig(sparsity=sparsity, steps=8, lr=0.05, batch_size=2, eval_every=4)
    model, report, stats = _run(config, model_type)
    for name, keep in _masks(model).items():
        assert torch.all(keep.reshape(-1, m).sum(1) == n), name
    assert [e["step"] for e in report.extra["hard_ppl"]] == [0, 4, 8]
    assert len(report.extra["loss_curve"]) == 8 and report.extra["loss_curve"][-1]["tau"] < 4
    assert all(k.endswith(".logits") for k in stats.tensors)
    assert all(p.requires_grad for p in model.parameters())  # unfrozen again afterwards


def test_fsdp_in_a_single_process_trains_exactly_as_without():
    config = dict(sparsity="2:4", steps=3, lr=0.05, batch_size=2, prior="magnitude")
    _, _, plain = _run(MaskLLMConfig(**config))
    _, _, flagged = _run(MaskLLMConfig(**config, fsdp=True))  # nothing to shard: logged, ignored
    assert plain.tensors.keys() == flagged.tensors.keys()
    assert all(torch.equal(plain.tensors[k], flagged.tensors[k]) for k in plain.tensors)


def test_bf16_autocast_trains_close_to_fp32():
    config = dict(sparsity="2:4", steps=4, lr=0.05, batch_size=2, prior="magnitude")
    _, fp32, _ = _run(MaskLLMConfig(**config))
    model, bf16, stats = _run(MaskLLMConfig(**config, bf16=True))
    ours = [h["loss"] for h in bf16.extra["loss_curve"]]
    theirs = [h["loss"] for h in fp32.extra["loss_curve"]]
    assert ours != theirs  # autocast was on
    assert ours == pytest.approx(theirs, rel=1e-2)
    assert all(t.dtype == torch.float32 for t in stats.tensors.values())  # fp32 logits
    for keep in _masks(model).values():
        assert torch.all(keep.reshape(-1, 4).sum(1) == 2)


def test_without_learning_the_mask_is_the_sparsegpt_prior():
    from conftest import make_tiny_model

    prior_model = make_tiny_model("llama")
    compress(prior_model, SparseGPTConfig(sparsity="2:4", update_weights=False), _data()[:-2])
    model, report, _ = _run(MaskLLMConfig(sparsity="2:4", steps=1, lr=1e-12))
    assert _same_masks(model, prior_model)
    assert report.extra["hard_ppl"][0]["step"] == 0


def test_killed_run_resumes_to_the_same_mask(tmp_path, monkeypatch):
    config = dict(sparsity="2:4", steps=6, lr=0.05, batch_size=2, prior="magnitude")
    straight, _, straight_stats = _run(MaskLLMConfig(**config))

    original_fit = Trainer.fit

    def killed_fit(self, data, resume=False, stop_after=None):  # noqa: ARG001
        original_fit(self, data, resume=resume, stop_after=4)
        raise KeyboardInterrupt  # the process dies after step 4's checkpoint

    ckpt = str(tmp_path / "ckpt")
    monkeypatch.setattr(Trainer, "fit", killed_fit)
    with pytest.raises(KeyboardInterrupt):
        _run(MaskLLMConfig(**config, checkpoint_dir=ckpt, checkpoint_every=2))
    monkeypatch.setattr(Trainer, "fit", original_fit)
    resumed, report, resumed_stats = _run(
        MaskLLMConfig(**config, checkpoint_dir=ckpt, checkpoint_every=2, resume=True)
    )
    for key, value in straight_stats.tensors.items():
        assert torch.equal(resumed_stats.tensors[key], value), key
    assert _same_masks(straight, resumed)
    assert report.extra["steps"] == 6


def test_export_round_trip_and_transfer(tmp_path):
    from conftest import make_tiny_tokenizer

    model, report, stats = _run(MaskLLMConfig(sparsity="2:4", steps=3, lr=0.05, batch_size=2))
    out = save_compressed(
        model, tmp_path / "out", report, tokenizer=make_tiny_tokenizer(), stats=stats
    )
    assert (out / "stats.safetensors").exists() and (out / "compressed.safetensors").exists()
    loaded, _, _ = load_compressed(out)
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    # A new run from the learned mask, learning nothing, keeps exactly that mask.
    transferred, _, _ = _run(
        MaskLLMConfig(sparsity="2:4", steps=1, lr=1e-12, prior_from=str(out), prior_strength=3.0)
    )
    assert _same_masks(model, transferred)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"sparsity": "0.5"}, "N:M"),
        ({"prior": "oracle"}, "prior must be"),
        ({"tau": (0.0, 1.0)}, "positive"),
        ({"resume": True}, "checkpoint-dir"),
        ({"steps": 0}, "steps must be"),
        ({"refit": "lstsq"}, "refit must be"),
        ({"noise": "fast"}, "noise must be"),
        ({"straight_through_from": 1.5}, "straight_through_from"),
        ({"checkpoint_dir": "nowhere", "resume": True}, "no checkpoint in nowhere"),
        ({"blockwise": True, "distill": True}, "distill"),
        ({"tune_steps": 5}, "--blockwise"),
        ({"blockwise": True, "tune_steps": 5, "quant_aware": "int8"}, "int8 grid"),
        ({"blockwise": True, "tune_steps": -1}, "tune_steps"),
        ({"blockwise": True, "fsdp": True}, "fsdp"),
    ],
)
def test_bad_options(options, message):
    with pytest.raises(ConfigError, match=message):
        config = MaskLLMConfig(**options)
        _run(config)


def _weights(model):
    return {n: weight_matrix(m).detach().clone() for n, m in LayerSelection().select(model).items()}


@pytest.mark.parametrize("refit", ["none", "sparsegpt"])
def test_blockwise_learning_nothing_is_sparsegpt(refit):
    """Block-wise with a learning rate of ~0 keeps the in-loop SparseGPT prior: without
    re-fitting that is SparseGPT's mask on the original weights, with it SparseGPT itself
    (the same masks and updated weights, block after block)."""
    from conftest import make_tiny_model

    reference = make_tiny_model("llama")
    sgpt = SparseGPTConfig(sparsity="2:4", update_weights=refit == "sparsegpt", calib_batch_size=2)
    compress(reference, sgpt, _data()[:-2])
    config = MaskLLMConfig(
        sparsity="2:4", steps=1, lr=1e-12, batch_size=2, blockwise=True, refit=refit
    )
    model, report, stats = _run(config)
    assert _same_masks(model, reference)
    expected = _weights(reference)
    for name, weight in _weights(model).items():
        torch.testing.assert_close(weight, expected[name], rtol=1e-4, atol=1e-5)
    assert [b["block"] for b in report.extra["block_curves"]] == [0, 1]
    assert report.extra["hard_ppl"][-1]["step"] == 1
    assert set(stats.tensors) == {f"{n}.logits" for n in _masks(model)}


def test_blockwise_training_lowers_the_block_error_and_ends_exactly_nm():
    config = MaskLLMConfig(
        sparsity="2:4", steps=30, lr=0.02, batch_size=2, blockwise=True, prior="magnitude"
    )
    model, report, _ = _run(config)
    for name, keep in _masks(model).items():
        assert torch.all(keep.reshape(-1, 4).sum(1) == 2), name
    for block in report.extra["block_curves"]:
        errors = [h["rel_err"] for h in block["curve"]]
        assert len(errors) == 30
        assert sum(errors[-5:]) / 5 < 0.8 * sum(errors[:5]) / 5, (block["block"], errors)


def test_blockwise_weight_tuning_keeps_the_masks_and_lowers_each_block_error():
    config = dict(sparsity="2:4", steps=6, lr=0.05, batch_size=2, blockwise=True,
                  prior="magnitude", refit="sparsegpt")  # fmt: skip
    plain, _, plain_stats = _run(MaskLLMConfig(**config))
    tuned, report, stats = _run(MaskLLMConfig(**config, tune_steps=15, tune_lr=1e-3))
    for key, value in plain_stats.tensors.items():  # block 0 trains the same logits
        if key.startswith("model.layers.0."):
            assert torch.equal(stats.tensors[key], value), key
    for name, keep in _masks(tuned).items():
        assert torch.all(keep.reshape(-1, 4).sum(1) <= 2), name
    for block in report.extra["block_curves"]:
        assert block["tune_after"] < 0.8 * block["tune_before"], block
    assert all(p.requires_grad for p in tuned.parameters())
    assert not any(hasattr(m, "parametrizations") for m in tuned.modules())


def _block0_inputs(data):
    """{name: (dense weight, inputs X (tokens, in))} of each block-0 layer of the dense tiny
    Llama on ``data``, from hooks (block 0 sees the same inputs in any compressed model)."""
    from conftest import make_tiny_model

    dense = make_tiny_model("llama")
    layers = {n: m for n, m in LayerSelection().select(dense).items() if ".layers.0." in n}
    inputs = {n: [] for n in layers}
    hooks = [
        module.register_forward_pre_hook(
            lambda _m, args, n=n: inputs[n].append(args[0].reshape(-1, args[0].shape[-1]))
        )
        for n, module in layers.items()
    ]
    with torch.no_grad():
        dense(data)
    for hook in hooks:
        hook.remove()
    return {
        n: (weight_matrix(m).detach().double(), torch.cat(inputs[n]).double())
        for n, m in layers.items()
    }


def _obs_refit_reference(W, keep, X, percdamp=0.01):
    """SparseGPT's weight update under a fixed mask, the textbook way (float64, no blocks, an
    explicit inverse per column): with the columns before ``j`` frozen, pruning column ``j``
    moves the free ones by ``−w_j / [H_F⁻¹]_00 · H_F⁻¹[0]``, ``H_F = H[j:, j:]``, ``H = 2/n XᵀX``
    dampened by ``percdamp`` of its mean diagonal."""
    H = 2 * X.T @ X / X.shape[0]
    H += percdamp * H.diagonal().mean() * torch.eye(H.shape[0], dtype=H.dtype)
    W = W.clone()
    for j in range(W.shape[1]):
        Hinv = torch.linalg.inv(H[j:, j:])
        pruned = torch.where(keep[:, j], 0.0, W[:, j])  # (out,)
        W[:, j:] -= torch.outer(pruned / Hinv[0, 0], Hinv[0])
    return W.masked_fill(~keep, 0)


def test_end_to_end_refit_keeps_the_learned_mask_and_lowers_output_error():
    config = dict(sparsity="2:4", steps=4, lr=0.05, batch_size=2, prior="magnitude")
    plain, _, plain_stats = _run(MaskLLMConfig(**config))
    refit, report, stats = _run(MaskLLMConfig(**config, refit="sparsegpt"))
    for key, value in plain_stats.tensors.items():  # same training, same logits
        assert torch.equal(stats.tensors[key], value), key
    assert _same_masks(plain, refit)
    reported = {layer.name: layer.rel_error for layer in report.layers}
    masked, refitted = _weights(plain), _weights(refit)
    block0 = _block0_inputs(_data()[:-2])  # the two last windows are held out (eval_windows)
    assert len(block0) == 7
    for name, (W, X) in block0.items():
        expected = _obs_refit_reference(W, masked[name] != 0, X)
        torch.testing.assert_close(refitted[name].double(), expected, rtol=1e-4, atol=1e-5)
        before, after = (
            float((X @ (w.double() - W).T).norm() / (X @ W.T).norm())
            for w in (masked[name], refitted[name])
        )
        assert after < before, (name, after, before)  # re-fitting lowers the output error
        assert reported[name] == pytest.approx(after, rel=1e-5), name  # and reports it
    assert report.extra["hard_ppl"][-1].get("refit") == "sparsegpt"
    assert all(layer.error_kind == "output" for layer in report.layers)


@pytest.mark.parametrize("option", [{"noise": "pool"}, {"straight_through_from": 0.5}])
def test_cheap_noise_and_late_straight_through_train(option, monkeypatch):
    """The logged ``flipped`` is the fraction of groups whose argmax pattern changed since the
    step before, recomputed here from the masks' logits; straight-through from its step on."""
    from lmcompress.methods.maskllm import learning

    seen = []  # per step: (fraction of groups whose argmax changed, straight-through flags)
    original = learning.schedules

    def spied(config, masks, steps):
        before_step = original(config, masks, steps)
        last = {n: m.logits.detach().argmax(-1) for n, m in masks.items()}

        def spy(step):
            now = {n: m.logits.detach().argmax(-1) for n, m in masks.items()}
            changed = sum(int((now[n] != last[n]).sum()) for n in masks)
            last.update(now)
            logs = before_step(step)
            flags = {m.straight_through for m in masks.values()}
            seen.append((changed / sum(t.numel() for t in now.values()), flags))
            return logs

        return spy

    monkeypatch.setattr(learning, "schedules", spied)
    model, report, stats = _run(
        MaskLLMConfig(sparsity="2:4", steps=6, lr=0.05, batch_size=2, prior="magnitude", **option)
    )
    for name, keep in _masks(model).items():
        assert torch.all(keep.reshape(-1, 4).sum(1) == 2), name
    flipped = [entry["flipped"] for entry in report.extra["loss_curve"]]
    assert flipped == pytest.approx([fraction for fraction, _ in seen], abs=1e-12)
    assert flipped[0] == 0 and any(f > 0 for f in flipped)  # the masks do change
    late = option.get("straight_through_from", 1.0) * 6
    assert [flags for _, flags in seen] == [{step >= late} for step in range(6)]
    baseline, _, base_stats = _run(
        MaskLLMConfig(sparsity="2:4", steps=6, lr=0.05, batch_size=2, prior="magnitude")
    )
    assert any(not torch.equal(stats.tensors[k], v) for k, v in base_stats.tensors.items())


def _killed_after(monkeypatch, step):
    """``Trainer.fit`` that dies after ``step`` steps (as a killed process would)."""
    original_fit = Trainer.fit

    def killed_fit(self, data, resume=False, stop_after=None):  # noqa: ARG001
        original_fit(self, data, resume=resume, stop_after=step)
        raise KeyboardInterrupt

    monkeypatch.setattr(Trainer, "fit", killed_fit)
    return original_fit


def test_resume_with_other_bookkeeping_is_the_uninterrupted_result(tmp_path, monkeypatch):
    """Killed with checkpoints every 2 steps and no evaluation in between; resumed with
    checkpoints every 3 and an evaluation every 2 steps: the same logits as a straight run."""
    config = dict(sparsity="2:4", steps=6, lr=0.05, batch_size=2, prior="magnitude")
    straight, _, straight_stats = _run(MaskLLMConfig(**config))
    ckpt = str(tmp_path / "ckpt")
    original_fit = _killed_after(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        _run(MaskLLMConfig(**config, checkpoint_dir=ckpt, checkpoint_every=2))
    monkeypatch.setattr(Trainer, "fit", original_fit)
    resumed, report, stats = _run(
        MaskLLMConfig(**config, checkpoint_dir=ckpt, checkpoint_every=3, eval_every=2, resume=True)
    )
    for key, value in straight_stats.tensors.items():
        assert torch.equal(stats.tensors[key], value), key
    assert _same_masks(straight, resumed)
    assert [e["step"] for e in report.extra["hard_ppl"]] == [0, 4, 6]  # evaluated after resume


def test_resume_with_other_options_is_one_line_before_any_work(tmp_path, monkeypatch):
    """A checkpoint of 2:4 masks resumed with 4:8 (other logits' shapes) and another lr: one
    ConfigError naming both, from validate (before the prior or any training)."""
    import lmcompress.methods.maskllm.end_to_end as end_to_end

    config = dict(steps=2, lr=0.05, batch_size=2, prior="magnitude", checkpoint_dir=str(tmp_path))
    _run(MaskLLMConfig(sparsity="2:4", **config, checkpoint_every=2))

    def no_work(*_args, **_kwargs):
        raise AssertionError("worked before refusing")

    monkeypatch.setattr(end_to_end, "prior_masks", no_work)
    monkeypatch.setattr(Trainer, "fit", no_work)
    other = MaskLLMConfig(sparsity="4:8", **{**config, "lr": 1e-3}, resume=True)
    with pytest.raises(ConfigError) as err:
        _run(other)
    assert str(err.value) == (
        f"checkpoint {tmp_path / 'trainer_state'} was written with other options: "
        "sparsity: 2:4 → 4:8; lr: 0.05 → 0.001; rerun without --resume or with the same options"
    )


def test_resume_from_a_truncated_checkpoint_is_one_line_naming_the_file(tmp_path):
    config = dict(sparsity="2:4", steps=2, lr=0.05, batch_size=2, prior="magnitude")
    _run(MaskLLMConfig(**config, checkpoint_dir=str(tmp_path), checkpoint_every=2))
    tensors = tmp_path / "trainer_state" / "state.safetensors"
    tensors.write_bytes(tensors.read_bytes()[:-100])
    with pytest.raises(LmcompressError) as err:
        _run(MaskLLMConfig(**config, checkpoint_dir=str(tmp_path), resume=True))
    text = str(err.value)
    assert "\n" not in text and text.startswith(f"checkpoint {tensors} is corrupt or incomplete")
    assert text.endswith("delete it or rerun without --resume")


def test_blockwise_run_killed_mid_block_resumes_to_the_same_masks(tmp_path, monkeypatch):
    config = dict(sparsity="2:4", steps=4, lr=0.02, batch_size=2, blockwise=True, prior="magnitude")
    straight, _, straight_stats = _run(MaskLLMConfig(**config))
    ckpt = str(tmp_path / "ckpt")
    original_fit, calls = Trainer.fit, []

    def killed_in_block_1(self, data, resume=False, stop_after=None):  # noqa: ARG001
        calls.append(None)
        if len(calls) == 1:
            return original_fit(self, data, resume=resume)
        original_fit(self, data, resume=resume, stop_after=3)
        raise KeyboardInterrupt

    monkeypatch.setattr(Trainer, "fit", killed_in_block_1)
    with pytest.raises(KeyboardInterrupt):
        _run(MaskLLMConfig(**config, checkpoint_dir=ckpt, checkpoint_every=2))
    monkeypatch.setattr(Trainer, "fit", original_fit)
    resumed, report, stats = _run(MaskLLMConfig(**config, checkpoint_dir=ckpt, resume=True))
    assert stats.tensors.keys() == straight_stats.tensors.keys()
    for key, value in straight_stats.tensors.items():
        assert torch.equal(stats.tensors[key], value), key
    assert _same_masks(straight, resumed)
    assert [len(b["curve"]) for b in report.extra["block_curves"]] == [4, 4]
