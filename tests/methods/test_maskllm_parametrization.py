import pytest
import torch
from torch.nn.utils import parametrize

from lmcompress.compressor.model.surgery import add_parametrization, bake, weight_matrix
from lmcompress.methods.maskllm.masks import init_logits
from lmcompress.methods.maskllm.parametrization import LearnableNMMask


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_parametrized_weight_is_masked_and_bakes_to_exact_nm(model_type):
    from conftest import make_tiny_model

    model = make_tiny_model(model_type)
    name = "model.layers.0.mlp.down_proj" if model_type == "llama" else "transformer.h.0.mlp.c_fc"
    module = model.get_submodule(name)
    W = weight_matrix(module).detach().clone()  # (out, in)
    logits = init_logits(W.numel() // 4, 6, generator=torch.Generator().manual_seed(0))
    mask = LearnableNMMask(logits, 2, 4, tuple(W.shape), transposed=model_type == "gpt2")
    add_parametrization(module, mask)
    assert parametrize.is_parametrized(module, "weight")

    soft = weight_matrix(module)  # one Gumbel sample
    assert soft.shape == W.shape and not torch.equal(soft, W)
    soft.sum().backward()  # gradients reach the logits only
    assert mask.logits.grad is not None and mask.logits.grad.abs().sum() > 0
    assert module.parametrizations.weight.original.grad is not None  # frozen by the trainer

    mask.hard = True
    hard = weight_matrix(module).detach()
    bake(module)
    assert not parametrize.is_parametrized(module, "weight")
    baked = weight_matrix(module).detach()
    assert torch.equal(baked, hard)
    assert torch.all((baked != 0).reshape(-1, 4).sum(1) == 2)
    kept = baked != 0
    assert torch.equal(baked[kept], W[kept])  # surviving weights unchanged


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError, match="do not cover"):
        LearnableNMMask(torch.zeros(3, 6), 2, 4, (4, 4))


def _linear_with_mask(
    out_features: int = 16, in_features: int = 32
) -> tuple[torch.nn.Linear, LearnableNMMask]:
    torch.manual_seed(0)
    module = torch.nn.Linear(in_features, out_features, bias=False)
    logits = init_logits(
        module.weight.numel() // 4, 6, std=0.3, generator=torch.Generator().manual_seed(0)
    )
    mask = LearnableNMMask(logits, 2, 4, (out_features, in_features))
    add_parametrization(module, mask)
    return module, mask


@pytest.mark.parametrize("noise", ["exact", "pool"])
def test_straight_through_weight_is_exactly_nm_with_logit_gradients(noise):
    module, mask = _linear_with_mask()
    W = module.parametrizations.weight.original.detach().clone()
    assert mask.noise == "exact" and not mask.straight_through  # the defaults
    mask.noise, mask.straight_through, mask.tau, mask.kappa = noise, True, 2.0, 10.0
    masked = weight_matrix(module)
    kept = masked.detach() != 0
    assert torch.all(kept.reshape(-1, 4).sum(1) == 2)  # exactly 2:4
    assert torch.equal(masked.detach()[kept], W[kept])  # kept weights unscaled
    masked.square().sum().backward()
    assert mask.logits.grad is not None and mask.logits.grad.abs().sum() > 0
    mask.hard = True  # evaluation stays the deterministic argmax of the logits
    assert torch.equal(mask.mask(), mask.candidates[mask.logits.argmax(-1)].reshape(16, 32))


def test_pooled_noise_mask_is_soft_and_reproducible_under_manual_seed():
    _, mask = _linear_with_mask()
    mask.noise = "pool"
    torch.manual_seed(1)
    first, second = mask.mask(), mask.mask()
    torch.manual_seed(1)
    assert torch.equal(mask.mask(), first) and torch.equal(mask.mask(), second)
    assert not torch.equal(first, second)
    torch.testing.assert_close(first.reshape(-1, 4).sum(1), torch.full((128,), 2.0))
    assert ((first > 0) & (first < 1)).any()  # soft without straight_through
    mask.noise = "fast"
    with pytest.raises(ValueError, match="noise must be one of"):
        mask.mask()


@pytest.mark.parametrize("recompute", [True, False])
def test_soft_mask_at_small_tau_has_no_subnormal_entries(recompute):
    """At τ → 0 the softmax underflows into subnormal floats, which make CPU GEMMs ~90x
    slower: the masked weight must hold none (entries below MASK_FLOOR become exact zeros)."""
    from lmcompress.methods.maskllm.masks import MASK_FLOOR
    from lmcompress.methods.maskllm.parametrization import LearnableNMMask

    logits = torch.randn(96 * 64 // 4, 6, generator=torch.Generator().manual_seed(0)) * 0.05
    mask = LearnableNMMask(logits, 2, 4, (96, 64))
    mask.recompute, mask.tau, mask.kappa = recompute, 0.05, 500.0
    torch.manual_seed(0)
    weight = torch.randn(96, 64)
    masked = mask(weight)
    tiny = torch.finfo(torch.float32).tiny  # the smallest normal float32
    nonzero = masked[masked != 0].abs()
    assert nonzero.numel() > 0 and nonzero.min() >= tiny
    values = mask.mask()
    assert torch.all((values == 0) | (values >= MASK_FLOOR))
    masked.sum().backward()
    assert torch.isfinite(mask.logits.grad).all()
