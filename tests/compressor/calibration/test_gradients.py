"""The gradient pass against autograd: Σ G², Σ xxᵀ, Σ δδᵀ, state restored, bounded memory."""

from __future__ import annotations

import gc
import math

import pytest
import torch
from torch import nn

from lmcompress.compressor.calibration.gradients import (
    GradientStats,
    gradient_statistics,
    gradient_stats_tensors,
)
from lmcompress.compressor.method import Stats
from lmcompress.compressor.model.surgery import LayerSelection, forward_hooks, weight_matrix
from lmcompress.errors import ConfigError
from tests.conftest import VOCAB, make_tiny_model

N_WINDOWS, SEQ = 5, 12  # 5 windows: batch_size 2 leaves a last batch of one


def _setup(family: str, dtype=torch.float64):
    model = make_tiny_model(family).to(dtype)
    layers = LayerSelection().select(model)
    data = torch.randint(3, VOCAB, (N_WINDOWS, SEQ), generator=torch.Generator().manual_seed(0))
    return model, layers, data


def _out_in(module: nn.Module, grad: torch.Tensor) -> torch.Tensor:
    """A weight gradient in ``weight_matrix`` orientation (GPT-2's Conv1D stores (in, out))."""
    return grad if weight_matrix(module) is module.weight else grad.T


def _loss(model, ids):
    return model(input_ids=ids, labels=ids, use_cache=False).loss


def _close(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    atol = 1e-12 * expected.abs().max().item()
    return actual.shape == expected.shape and torch.allclose(actual, expected, 1e-9, atol)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("batch_size", [1, 2])
def test_fisher_is_sum_of_squared_batch_gradients(family, batch_size):
    """A sample is one batch; its gradient is the mean of its windows' gradients (mean loss
    over equal-length windows), each window's gradient computed by autograd on its own."""
    model, layers, data = _setup(family)
    weights = [module.weight for module in layers.values()]
    per_window = [torch.autograd.grad(_loss(model, data[i : i + 1]), weights) for i in range(5)]
    expected = {name: 0 for name in layers}
    for first in range(0, N_WINDOWS, batch_size):
        batch = per_window[first : first + batch_size]
        for k, (name, module) in enumerate(layers.items()):
            g = _out_in(module, sum(grads[k] for grads in batch) / len(batch))
            expected[name] = expected[name] + g * g

    stats = gradient_statistics(
        model,
        data,
        layers,
        batch_size=batch_size,
        kronecker=False,
        progress=False,
        dtype=torch.float64,
    )
    assert list(stats) == list(layers)
    for name, module in layers.items():
        assert stats[name].fisher.shape == weight_matrix(module).shape
        assert _close(stats[name].fisher, expected[name]), name
        assert stats[name].xx is None and stats[name].dd is None
        assert stats[name].samples == math.ceil(N_WINDOWS / batch_size)
        assert stats[name].tokens == N_WINDOWS * SEQ
    assert all(w.grad is None for w in weights)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_kronecker_factors_match_autograd(family):
    model, layers, data = _setup(family)
    names = list(layers)
    expected_xx = {name: 0 for name in names}
    expected_dd = {name: 0 for name in names}
    for first in range(0, N_WINDOWS, 2):
        inputs, outputs = {}, {}

        def capture(name, _module, args, output, inputs=inputs, outputs=outputs):
            inputs[name], outputs[name] = args[0], output

        with forward_hooks(layers, capture):
            loss = _loss(model, data[first : first + 2])
        deltas = torch.autograd.grad(loss, [outputs[name] for name in names])
        for name, delta in zip(names, deltas, strict=True):
            x = inputs[name].reshape(-1, inputs[name].shape[-1])  # (tokens, in)
            d = delta.reshape(-1, delta.shape[-1])  # (tokens, out)
            expected_xx[name] = expected_xx[name] + x.T @ x
            expected_dd[name] = expected_dd[name] + d.T @ d

    stats = gradient_statistics(
        model, data, layers, batch_size=2, fisher=False, progress=False, dtype=torch.float64
    )
    for name in names:
        assert stats[name].fisher is None
        assert _close(stats[name].xx, expected_xx[name].detach()), name
        assert _close(stats[name].dd, expected_dd[name]), name
        assert expected_dd[name].abs().max() > 0


class _OneLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.proj = nn.Linear(8, 6)


def _one_token_loss(model, ids):
    logits = model.proj(model.embed(ids)).reshape(-1, 6)  # (1, 6)
    return nn.functional.cross_entropy(logits, ids.reshape(-1) % 6)


def test_single_token_gradient_is_outer_product_of_factors():
    """One token through one linear: G = δ xᵀ, so G ⊙ G = diag(δδᵀ) diag(xxᵀ)ᵀ exactly; also a
    plain nn.Module with its own loss_fn (no Hugging Face model needed)."""
    torch.manual_seed(0)
    model = _OneLinear().double()
    stats = gradient_statistics(
        model,
        torch.tensor([[7]]),
        {"proj": model.proj},
        loss_fn=_one_token_loss,
        progress=False,
        dtype=torch.float64,
    )["proj"]
    expected = torch.outer(stats.dd.diagonal(), stats.xx.diagonal())
    assert stats.tokens == 1 and stats.samples == 1
    assert _close(stats.fisher, expected)
    assert stats.fisher.abs().max() > 0


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_checkpointing_gives_the_same_numbers(family):
    model, layers, data = _setup(family)
    plain = gradient_statistics(
        model, data, layers, batch_size=2, progress=False, dtype=torch.float64
    )
    first = next(iter(layers.values()))
    calls = []
    handle = first.register_forward_hook(lambda *_: calls.append(1))
    checkpointed = gradient_statistics(
        model,
        data,
        layers,
        batch_size=2,
        checkpointing=True,
        progress=False,
        dtype=torch.float64,
    )
    handle.remove()
    assert len(calls) == 2 * 3  # every block ran again in backward: checkpointing was on
    for name in layers:
        for key in ("fisher", "xx", "dd"):
            assert _close(getattr(checkpointed[name], key), getattr(plain[name], key)), name
        assert checkpointed[name].tokens == plain[name].tokens == N_WINDOWS * SEQ
    blocks = model.get_submodule("model.layers" if family == "llama" else "transformer.h")
    assert all("forward" not in vars(block) for block in blocks)


def _state(model):
    return (
        [(n, p.requires_grad) for n, p in model.named_parameters()],
        [(n, m.training) for n, m in model.named_modules()],
    )


def _assert_clean(model, before):
    assert _state(model) == before
    assert all(p.grad is None for p in model.parameters())
    assert all(not m._forward_hooks for m in model.modules())
    assert all(not getattr(p, "_post_accumulate_grad_hooks", None) for p in model.parameters())


def test_state_restored_and_pass_runs_without_dropout():
    """Mixed flags and train mode come back as they were; the pass itself runs in eval mode
    (GPT-2's dropout of 0.1 would change the numbers)."""
    model, layers, data = _setup("gpt2")
    model.train()
    model.transformer.h[0].eval()
    model.transformer.wte.weight.requires_grad_(False)
    model.transformer.h[1].mlp.c_fc.weight.requires_grad_(False)  # a selected layer
    before = _state(model)
    trained = gradient_statistics(model, data, layers, progress=False, dtype=torch.float64)
    _assert_clean(model, before)
    reference_model, reference_layers, _ = _setup("gpt2")  # same seed: same weights, eval mode
    reference = gradient_statistics(
        reference_model, data, reference_layers, progress=False, dtype=torch.float64
    )
    for name in layers:
        assert torch.equal(trained[name].fisher, reference[name].fisher)
        assert torch.equal(trained[name].dd, reference[name].dd)


def test_state_restored_on_error():
    model, layers, data = _setup("llama")
    model.lm_head.weight.requires_grad_(False)  # tied: the embeddings too
    before = _state(model)
    calls = []

    def failing_loss(m, ids):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return _loss(m, ids)

    with pytest.raises(RuntimeError, match="boom"):
        gradient_statistics(
            model, data, layers, checkpointing=True, loss_fn=failing_loss, progress=False
        )
    _assert_clean(model, before)
    assert all("forward" not in vars(block) for block in model.model.layers)


def _live_tensor_ids(collect: bool = True) -> set[int]:
    if collect:
        gc.collect()
    return {id(obj) for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor)}


def test_memory_is_bounded_by_the_accumulators():
    """Live tensors do not grow with the windows seen, and after the pass the only new
    tensors are the accumulators (nothing per sample, no activations, no .grad)."""
    model, layers, data = _setup("llama", torch.float32)
    counts = []

    def counting_loss(m, ids):
        counts.append(len(_live_tensor_ids(collect=False)))  # 0.5 s a census
        return _loss(m, ids)

    before = _live_tensor_ids()
    stats = gradient_statistics(model, data[:4], layers, loss_fn=counting_loss, progress=False)
    new = _live_tensor_ids() - before
    accumulators = {id(getattr(s, key)) for s in stats.values() for key in ("fisher", "xx", "dd")}
    assert new == accumulators
    assert len(counts) == 4 and len(set(counts[1:])) == 1, counts


def test_stats_round_trip(tmp_path):
    model, layers, data = _setup("llama", torch.float32)
    stats = gradient_statistics(model, data[:2], layers, progress=False)
    name = next(iter(layers))
    assert stats[name].fisher.dtype == torch.float32
    tensors = gradient_stats_tensors(stats)
    assert {f"{name}.{k}" for k in ("fisher", "xx", "dd", "samples", "tokens")} <= set(tensors)
    Stats(tensors=tensors).save(tmp_path / "grad.safetensors")
    loaded = Stats.load(tmp_path / "grad.safetensors")
    for layer in layers:
        back = GradientStats.from_tensors(loaded.tensors, layer)
        assert (back.samples, back.tokens) == (2, 2 * SEQ)
        for key in ("fisher", "xx", "dd"):
            assert torch.equal(getattr(back, key), getattr(stats[layer], key))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"fisher": False, "kronecker": False}, "fisher, kronecker"),
        ({"data": torch.zeros(12, dtype=torch.long)}, "LongTensor"),
        ({"data": torch.zeros(2, 1, dtype=torch.long)}, ">= 2 tokens"),
        ({"layers": {"model.norm": None}}, "not a linear"),
        ({"layers": {"model.layers.0.mlp.up_proj": nn.Linear(32, 64)}}, "not that module"),
        ({"dtype": torch.float16}, "float32 or float64"),
    ],
)
def test_bad_arguments_are_config_errors(change, message):
    model, layers, data = _setup("llama", torch.float32)
    kwargs = {"data": data, "layers": layers, "progress": False, **change}
    if "model.norm" in kwargs["layers"]:
        kwargs["layers"] = {"model.norm": model.model.norm}
    with pytest.raises(ConfigError, match=message):
        gradient_statistics(model, kwargs.pop("data"), kwargs.pop("layers"), **kwargs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_accumulates_on_the_model_device():
    model, layers, data = _setup("llama")
    on_cpu = gradient_statistics(model, data, layers, progress=False, dtype=torch.float64)
    model.cuda()
    on_gpu = gradient_statistics(model, data, layers, progress=False, dtype=torch.float64)
    for name in layers:
        for key in ("fisher", "xx", "dd"):
            value = getattr(on_gpu[name], key)
            assert value.device.type == "cuda"
            # float64 sums of float32 activations, which the GPU computes in another order
            reference = getattr(on_cpu[name], key)
            scale = reference.abs().max().item()
            torch.testing.assert_close(value.cpu(), reference, rtol=1e-4, atol=1e-6 * scale)
