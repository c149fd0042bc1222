"""``--calib self``: calibration windows sampled from the model (LLM-QAT's data-free recipe)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model, make_tiny_tokenizer

import lmcompress.evaluation.generated as generated
from lmcompress.errors import ConfigError
from lmcompress.evaluation.generated import GREEDY_TOKENS, sample_windows
from lmcompress.jobs.options import RunOptions
from lmcompress.jobs.run import run
from lmcompress.methods.wanda import WandaConfig


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return make_tiny_model("llama"), make_tiny_tokenizer()


def test_windows_follow_the_recipe(model_and_tokenizer):
    """First token ordinary, the next GREEDY_TOKENS the model's top-1 (recomputed without the
    KV cache, so the cache's positions are checked too), then samples that are not all top-1."""
    model, tokenizer = model_and_tokenizer
    windows = sample_windows(model, tokenizer, nsamples=6, seq_len=24, seed=0, batch_size=4)
    assert windows.shape == (6, 24) and windows.dtype == torch.long
    assert not set(windows[:, 0].tolist()) & set(tokenizer.all_special_ids)
    with torch.no_grad():
        logits = model(input_ids=windows, use_cache=False).logits  # (6, 24, vocab)
    top1 = logits.argmax(dim=-1)  # top1[:, t] predicts position t + 1
    assert torch.equal(windows[:, 1 : GREEDY_TOKENS + 1], top1[:, :GREEDY_TOKENS])
    sampled, greedy = windows[:, GREEDY_TOKENS + 1 :], top1[:, GREEDY_TOKENS:-1]
    assert (sampled != greedy).float().mean() > 0.5  # a random tiny model is nearly uniform


def test_each_step_sees_the_whole_window(model_and_tokenizer, monkeypatch):
    """The logits of every step (through the KV cache) equal a full forward pass's."""
    model, tokenizer = model_and_tokenizer
    steps = []
    real = generated._next_token

    def spy(logits, greedy, generator):
        steps.append(logits)
        return real(logits, greedy, generator)

    monkeypatch.setattr(generated, "_next_token", spy)
    windows = sample_windows(model, tokenizer, nsamples=3, seq_len=12, seed=2)
    with torch.no_grad():
        logits = model(input_ids=windows, use_cache=False).logits  # (3, 12, vocab)
    assert len(steps) == 11
    torch.testing.assert_close(torch.stack(steps, dim=1), logits[:, :-1], rtol=1e-4, atol=1e-4)


def test_first_tokens_are_ordinary(model_and_tokenizer):
    _, tokenizer = model_and_tokenizer
    generator = torch.Generator().manual_seed(0)
    starts = generated._start_tokens(tokenizer, 5000, generator)
    special = set(tokenizer.all_special_ids)
    assert set(starts.tolist()) == set(range(len(tokenizer))) - special


def test_samples_follow_the_model_distribution(model_and_tokenizer):
    """The sampled tokens' mean log-probability under the model matches its expected value
    (minus the entropy) within a few standard errors: samples from the softmax, not uniform."""
    model, tokenizer = model_and_tokenizer
    with torch.no_grad():  # sharpen the tiny model so that uniform and softmax samples differ
        model.lm_head.weight.mul_(40.0)
    try:
        windows = sample_windows(model, tokenizer, nsamples=16, seq_len=40, seed=1)
        with torch.no_grad():
            logp = model(input_ids=windows, use_cache=False).logits.log_softmax(-1)
    finally:
        with torch.no_grad():
            model.lm_head.weight.div_(40.0)
    logp, chosen = logp[:, GREEDY_TOKENS:-1], windows[:, GREEDY_TOKENS + 1 :]
    got = logp.gather(-1, chosen[..., None]).squeeze(-1)  # (16, T)
    expected = (logp.exp() * logp).sum(-1)  # minus the entropy at each position
    assert (got - expected).mean().abs() < 4 * got.std() / got.numel() ** 0.5
    assert expected.mean() > logp.mean(-1).mean() + 1.0  # uniform samples would sit far below


def test_windows_depend_on_the_seed_only(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    first = sample_windows(model, tokenizer, 3, 16, seed=5, batch_size=2)
    assert torch.equal(first, sample_windows(model, tokenizer, 3, 16, seed=5, batch_size=2))
    assert not torch.equal(first, sample_windows(model, tokenizer, 3, 16, seed=6, batch_size=2))
    assert model.training is False


def test_the_default_batch_bounds_the_kv_cache(model_and_tokenizer, monkeypatch):
    model, _ = model_and_tokenizer
    config = model.config
    per_window = 2 * config.num_hidden_layers * config.num_key_value_heads * 4 * 64
    per_window *= config.hidden_size // config.num_attention_heads
    monkeypatch.setattr(generated, "KV_CACHE_BYTES", 3 * per_window)
    assert generated._batch_size(model, 64) == 3
    monkeypatch.setattr(generated, "KV_CACHE_BYTES", 1)
    assert generated._batch_size(model, 64) == 1


def test_a_job_calibrates_on_self_text(tiny_checkpoint, monkeypatch):
    """``calib="self"`` reaches the sampler (with the dense model) and wanda runs on it."""
    calls = []

    def spy(model, tokenizer, nsamples, seq_len, seed):
        calls.append(
            (
                nsamples,
                seq_len,
                float(model.model.layers[0].mlp.up_proj.weight.detach().abs().min()),
            )
        )
        return sample_windows(model, tokenizer, nsamples, seq_len, seed)

    monkeypatch.setattr("lmcompress.jobs.evaluate.sample_windows", spy)
    options = RunOptions(
        checkpoint=str(tiny_checkpoint), calib="self", eval=(), seq_len=16, nsamples=3
    )
    results = run(options, WandaConfig(sparsity=0.5))
    assert calls and calls[0][:2] == (3, 16) and calls[0][2] > 0  # dense: no zeroed weight yet
    assert results["summary"]


def test_streaming_refuses_self_text(tiny_checkpoint, tmp_path):
    options = RunOptions(
        checkpoint=str(tiny_checkpoint), calib="self", eval=(), streaming=True,
        output=str(tmp_path / "out"),
    )  # fmt: skip
    with pytest.raises(ConfigError, match="--calib self"):
        run(options, WandaConfig(sparsity=0.5))
    assert not (tmp_path / "out").exists()
