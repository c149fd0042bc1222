import pytest
import torch
from torch.nn.utils import parametrize

from lmcompress.compressor.surgery import add_parametrization, bake, weight_matrix
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
