"""``stats_nsamples``: the low-rank statistics (and so the ranks) from the first N calibration
windows, the block-by-block pass and the distillation from all of them (the low-rank recipe's
512 distillation windows over 128 windows of gradient statistics)."""

import dataclasses

import pytest
import torch
from conftest import make_tiny_model

from lmcompress import compress
from lmcompress.compressor.model.surgery import LayerSelection, weight_matrix
from lmcompress.errors import ConfigError
from lmcompress.methods import get_method
from lmcompress.methods.svd import GFWSVDConfig, SVDLLMConfig
from lmcompress.methods.svd import method as lowrank_method


def _data(n=8):
    return torch.randint(0, 256, (n, 32), generator=torch.Generator().manual_seed(0))


NAMES = list(LayerSelection().select(make_tiny_model("llama")))  # before any is replaced


def _weights(model):
    modules = {name: model.get_submodule(name) for name in NAMES}
    return {
        name: (m.dense_weight() if hasattr(m, "dense_weight") else weight_matrix(m)).detach()
        for name, m in modules.items()
    }


def test_one_shot_statistics_are_those_of_the_first_windows():
    first, ours, every = (make_tiny_model("llama") for _ in range(3))
    compress(first, SVDLLMConfig(ratio=0.6, allocation="greedy"), _data()[:3])
    compress(ours, SVDLLMConfig(ratio=0.6, allocation="greedy", stats_nsamples=3), _data())
    compress(every, SVDLLMConfig(ratio=0.6, allocation="greedy"), _data())
    mine, theirs, all_windows = _weights(ours), _weights(first), _weights(every)
    for name in mine:
        torch.testing.assert_close(mine[name], theirs[name])
    assert any(not torch.allclose(mine[n], all_windows[n]) for n in mine)  # the option acts


def test_block_pass_takes_every_window_and_statistics_the_first(monkeypatch):
    seen = []
    sequential = lowrank_method.compress_sequential

    def spy(method, model, data, stats):
        seen.append(data.shape[0])
        return sequential(method, model, data, stats)

    monkeypatch.setattr(lowrank_method, "compress_sequential", spy)
    config = GFWSVDConfig(ratio=0.6, allocation="greedy", calib_batch_size=2, refit="output")
    runs = {
        "first": (config, _data()[:4]),
        "ours": (dataclasses.replace(config, stats_nsamples=4), _data()),
        "every": (config, _data()),
    }
    stats = {}
    for run, (options, data) in runs.items():
        _, stats[run] = get_method("gfwsvd")(options).compress(make_tiny_model("llama"), data)
    assert seen == [4, 8, 8]  # the block-by-block pass: every window
    assert stats["ours"].tensors.keys() == stats["first"].tensors.keys()
    for key, tensor in stats["ours"].tensors.items():  # the statistics: the first 4
        torch.testing.assert_close(tensor, stats["first"].tensors[key])
    assert any(
        not torch.allclose(tensor, stats["every"].tensors[key])
        for key, tensor in stats["ours"].tensors.items()
    )


def test_more_statistics_windows_than_there_are_is_refused_before_any_pass():
    model = make_tiny_model("llama")
    method = get_method("gfwsvd")(GFWSVDConfig(stats_nsamples=16))
    with pytest.raises(ConfigError, match="--stats-nsamples 16 exceeds the 8 calibration"):
        method.memory_estimate(model, 8, 32)
    before = {n: w.clone() for n, w in _weights(model).items()}
    with pytest.raises(ConfigError, match="exceeds the 8"):
        compress(model, GFWSVDConfig(stats_nsamples=16, calib_batch_size=2), _data())
    after = _weights(model)
    assert all(torch.equal(before[n], after[n]) for n in before)
    with pytest.raises(ConfigError, match="stats_nsamples must be >= 0"):
        GFWSVDConfig(stats_nsamples=-1)


def test_nearest_kronecker_memory_counts_the_statistics_windows():
    model = make_tiny_model("llama")
    config = GFWSVDConfig(kronecker="nearest", calib_batch_size=1)
    few = get_method("gfwsvd")(config).memory_estimate(model, 4, 32)
    ours = get_method("gfwsvd")(dataclasses.replace(config, stats_nsamples=4)).memory_estimate(
        model, 64, 32
    )
    every = get_method("gfwsvd")(config).memory_estimate(model, 64, 32)
    assert ours["per-sample gradients"] == few["per-sample gradients"]
    assert every["per-sample gradients"] == 16 * few["per-sample gradients"]
