"""Layers that read one tensor (q/k/v, gate/up) accumulate its statistics once: the copies must
be bit-identical to folding every layer's input in itself, and a copy must never stand in for a
different input or a different history."""

import pytest
import torch
from conftest import make_tiny_model

from lmcompress.compressor.calibration.layerwise import compress_layerwise
from lmcompress.compressor.calibration.observers import (
    HessianAccumulator,
    MeanAbsObserver,
    SharedInputFeed,
)
from lmcompress.compressor.model.surgery import LayerSelection, weight_matrix
from lmcompress.compressor.report import LayerReport


def _x(seed: int, tokens: int = 12, width: int = 8) -> torch.Tensor:
    return torch.randn(2, tokens, width, generator=torch.Generator().manual_seed(seed))


def _alone(inputs: list[torch.Tensor], dtype=torch.float32, width: int = 8) -> HessianAccumulator:
    """An accumulator fed only ``inputs``, each folded in itself."""
    acc = HessianAccumulator(width, dtype=dtype)
    for x in inputs:
        acc.add_batch(x)
    return acc


def test_a_shared_input_is_folded_in_once_and_copied_bit_identically():
    accs = {n: HessianAccumulator(8) for n in ("q", "k", "v", "o")}
    feed = SharedInputFeed(accs)
    calls = []
    original = HessianAccumulator._update
    seen = {"q": [], "k": [], "v": [], "o": []}
    try:
        HessianAccumulator._update = lambda self, rows: (calls.append(1), original(self, rows))
        for batch in range(3):
            x, other = _x(batch), _x(10 + batch, tokens=5 + batch)
            for name, value in (("q", x), ("k", x), ("v", x), ("o", other)):
                feed(name, value)
                seen[name].append(value)
            feed.next_batch()
    finally:
        HessianAccumulator._update = original
    assert len(calls) == 6  # q and o each batch; k and v copied q's
    assert feed.source == {"q": None, "k": "q", "v": "q", "o": None}
    for name, acc in accs.items():
        alone = _alone(seen[name])
        assert acc.tokens == alone.tokens
        assert torch.equal(acc.H, alone.H), name
        assert acc.H.data_ptr() != accs["q"].H.data_ptr() or name == "q"  # copies, not aliases


def test_equal_values_in_another_tensor_or_a_tensor_changed_in_place_are_folded_in():
    accs = {n: HessianAccumulator(8) for n in ("a", "b", "c")}
    feed = SharedInputFeed(accs)
    x = _x(0)
    feed("a", x)
    feed("b", x.clone())  # same values, another tensor: computed (identity is the contract)
    x.mul_(2.0)  # changed in place after "a" read it
    feed("c", x)
    assert feed.source == {"a": None, "b": None, "c": None}
    assert torch.equal(accs["c"].H, _alone([x]).H)
    assert not torch.equal(accs["c"].H, accs["a"].H)


def test_a_layer_whose_history_differs_is_never_copied_again():
    """b shares a's input on batches 0 and 2, not on batch 1: from batch 1 on b's state is its
    own, and copying a's at batch 2 would give a's sum over a's inputs."""
    accs = {"a": HessianAccumulator(8), "b": HessianAccumulator(8)}
    feed = SharedInputFeed(accs)
    inputs = {"a": [_x(0), _x(1), _x(2)], "b": [None, _x(7), None]}
    for batch in range(3):
        x = inputs["a"][batch]
        feed("a", x)
        feed("b", x if inputs["b"][batch] is None else inputs["b"][batch])
        feed.next_batch()
    b_inputs = [inputs["a"][0], inputs["b"][1], inputs["a"][2]]
    assert torch.equal(accs["b"].H, _alone(b_inputs).H)
    assert feed.source["b"] is None


def test_a_layer_first_fed_alone_is_not_copied_later():
    """b's first batch had its own input: a later shared input does not make it a's copy."""
    accs = {"a": HessianAccumulator(8), "b": HessianAccumulator(8)}
    feed = SharedInputFeed(accs)
    first, second = _x(0), _x(1)
    feed("a", first)
    feed("b", _x(5))
    feed.next_batch()
    feed("a", second)
    feed("b", second)
    assert torch.equal(accs["b"].H, _alone([_x(5), second]).H)


def test_accumulators_of_another_kind_or_dtype_fold_their_input_in_themselves():
    accs = {
        "a": HessianAccumulator(8),
        "b": HessianAccumulator(8, dtype=torch.float64),
        "c": MeanAbsObserver(),  # no mirror
        "d": HessianAccumulator(8),
    }
    feed = SharedInputFeed(accs)
    x = _x(3)
    for name in accs:
        feed(name, x)
    assert feed.source == {"a": None, "b": None, "c": None, "d": "a"}
    assert torch.equal(accs["b"].H, _alone([x], dtype=torch.float64).H)
    assert accs["b"].H.dtype == torch.float64
    torch.testing.assert_close(accs["c"].mean_abs, x.abs().reshape(-1, 8).mean(0))


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_layerwise_hessians_equal_each_layers_own_and_shared_ones_are_copied(family, monkeypatch):
    """On a model: every layer's Hessian equals the one of an accumulator fed only that layer's
    inputs; on llama q/k/v and gate/up share one accumulation (GPT-2's fused c_attn reads its
    input alone)."""
    model = make_tiny_model(family)
    layers = LayerSelection().select(model)
    data = torch.randint(3, 256, (6, 16), generator=torch.Generator().manual_seed(0))
    made: dict[str, HessianAccumulator] = {}
    inputs: dict[str, list[torch.Tensor]] = {n: [] for n in layers}
    updates: list[int] = []
    original = HessianAccumulator._update
    monkeypatch.setattr(
        HessianAccumulator, "_update", lambda self, rows: (updates.append(1), original(self, rows))
    )

    def make(name, module):
        made[name] = HessianAccumulator(weight_matrix(module).shape[1])
        module.register_forward_pre_hook(lambda _m, args: inputs[name].append(args[0].clone()))
        return made[name]

    def keep(name, module, _acc):
        W = weight_matrix(module)
        return LayerReport(name, tuple(W.shape), W.numel(), W.numel(), 0, 0)

    compress_layerwise(model, data, layers, make, keep, batch_size=2, progress=False)
    monkeypatch.setattr(HessianAccumulator, "_update", original)
    for name, acc in made.items():
        observed = inputs[name][:3]  # the observing pass (the second one computes outputs)
        assert torch.equal(acc.H, _alone(observed, width=acc.H.shape[0]).H), name
    per_block = 7 if family == "llama" else 4  # gpt2: c_attn, attn.c_proj, c_fc, mlp.c_proj
    assert len(updates) == 3 * 4 * (len(layers) // per_block)  # 3 batches, 4 distinct inputs
