"""MaskLLM's stats are tensors plus JSON metadata: saved, loaded and applied to a fresh copy of
the model they give the same masks and the same report; the report says how many mask logits
each process trained."""

import pytest
import torch

from lmcompress import MaskLLMConfig, compress
from lmcompress.compressor.method import Stats
from lmcompress.compressor.model.surgery import LayerSelection, weight_matrix
from lmcompress.methods.maskllm.method import MaskLLM


def _data():
    return torch.randint(3, 256, (10, 32), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("blockwise", [False, True])
def test_stats_round_trip_and_apply_on_a_fresh_model(tmp_path, blockwise):
    from conftest import make_tiny_model

    config = MaskLLMConfig(
        sparsity="2:4", steps=3, lr=0.05, batch_size=2, prior="magnitude", blockwise=blockwise
    )
    model = make_tiny_model("llama")
    report, stats = compress(model, config, _data(), return_stats=True)
    stats.save(tmp_path / "stats.safetensors")
    loaded = Stats.load(tmp_path / "stats.safetensors")
    assert loaded.meta == stats.meta
    assert all(torch.equal(loaded.tensors[k], v) for k, v in stats.tensors.items())

    fresh = make_tiny_model("llama")
    again = MaskLLM(config).apply(fresh, loaded)
    for name, module in LayerSelection().select(model).items():
        ours = weight_matrix(LayerSelection().select(fresh)[name])
        assert torch.equal(ours, weight_matrix(module)), name
    assert again.extra == report.extra
    logits = sum(t.numel() for t in stats.tensors.values())
    assert report.extra["trainable_elements_per_process"] == logits > 0
