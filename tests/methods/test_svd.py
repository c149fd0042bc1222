"""The plain truncated-SVD method ``svd``: per-layer ranks, what stays dense, the parameter
budget, bad ratios, the CLI, and export/reload of the ``low_rank`` layers by replay."""

import json
import logging

import pytest
import torch
from conftest import make_tiny_model
from safetensors import safe_open
from torch import nn

from lmcompress import compress
from lmcompress.cli.main import main
from lmcompress.compressor.formats.low_rank import LowRankLinear
from lmcompress.compressor.io.layout import COMPRESSED_TENSORS, MANIFEST
from lmcompress.compressor.model.surgery import LayerSelection, in_out_features, weight_matrix
from lmcompress.errors import ConfigError
from lmcompress.methods.common import count_params
from lmcompress.methods.svd import SVDConfig
from lmcompress.methods.svd.ranks import budget_rank, smallest_greedy_ratio, smallest_ratio


def _inputs():
    return torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    ("out_features", "in_features", "ratio", "expected"),
    [
        (32, 32, 0.8, 8),  # 12.8 -> 12 -> 8
        (64, 32, 0.8, 16),  # 17.07 -> 17 -> 16
        (1536, 576, 0.8, 328),  # 335.13 -> 335 -> 328 (SmolLM2 MLP)
        (576, 576, 0.5, 144),  # exactly 144, already a multiple of 8
        (32, 32, 0.3, None),  # 4.8 -> 0: stays dense
        (16, 32, 0.5, None),  # 5.33 -> 0: stays dense
        (576, 1536, 1.0, None),  # ratio 1: the dense layer fits the budget
    ],
)
def test_budget_rank(out_features, in_features, ratio, expected):
    assert budget_rank(out_features, in_features, ratio) == expected


SMOLLM2 = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]


@pytest.mark.parametrize(
    ("shapes", "expected", "index"),
    [
        (SMOLLM2, 0.0191, 4),  # 8·2112/(1536·576) = 0.019097: the MLP compresses first
        ([(32, 32), (16, 32), (64, 32)], 0.375, 2),  # 8·96/2048 exactly: no rounding up
        ([(16, 16), (8, 4096)], None, None),  # rank 8 saves nothing in either
    ],
)
def test_smallest_ratio_is_where_the_first_rank_appears(shapes, expected, index):
    found = smallest_ratio(shapes)
    if expected is None:
        assert found is None
        return
    assert found == (expected, index)
    assert budget_rank(*shapes[index], expected) == 8
    exact = min(8 * (m + n) / (m * n) for m, n in shapes if 8 * (m + n) < m * n)
    assert exact <= expected < exact * 1.01  # rounded up to three digits, no further
    assert all(budget_rank(m, n, exact * 0.999) is None for m, n in shapes)


def test_smallest_greedy_ratio_covers_rank_8_everywhere():
    floor = smallest_greedy_ratio(SMOLLM2)
    total, needed = sum(m * n for m, n in SMOLLM2), sum(8 * (m + n) for m, n in SMOLLM2)
    assert floor == 0.0231 and floor * total >= needed > (floor - 0.0001) * total


def test_budget_rank_refuses_factors_that_save_nothing():
    # multiple 1, ratio just under 1 on a square 16x16: r = floor(7.992) = 7, 7*32 < 256
    assert budget_rank(16, 16, 0.999, multiple=1) == 7
    # 8 would store 8*(16+16) = 256 = 16*16 parameters: no saving, stays dense
    assert budget_rank(16, 16, 1.0, multiple=1) is None


@pytest.mark.parametrize("ratio", [0.8, 0.5])
def test_every_family_within_the_budget(family_model, ratio):
    model_type, model = family_model
    layers = LayerSelection().select(model)
    shapes = {name: tuple(weight_matrix(m).shape) for name, m in layers.items()}
    originals = {name: weight_matrix(m).detach().clone() for name, m in layers.items()}
    dense_logits = model(_inputs()).logits
    params_before = count_params(model)

    report = compress(model, SVDConfig(ratio=ratio))
    assert [layer.name for layer in report.layers] == list(layers), model_type
    for layer in report.layers:
        m, n = shapes[layer.name]
        rank = budget_rank(m, n, ratio)
        module = model.get_submodule(layer.name)
        assert layer.rank == rank, layer.name
        if rank is None:  # stays the original module, reported as dense
            assert module is layers[layer.name]
            assert layer.format is None and layer.params_kept == layer.params == m * n
            assert layer.rel_error == 0.0
            continue
        assert isinstance(module, LowRankLinear) and module.rank == rank
        assert (module.out_features, module.in_features) == (m, n)
        assert layer.format == "low_rank" and layer.format_options == {"rank": rank}
        assert layer.params_kept == rank * (m + n) and layer.params == m * n
        assert layer.bytes_compressed == rank * (m + n) * 4 and layer.bytes_dense == m * n * 4
        W = module.dense_weight()
        assert torch.linalg.matrix_rank(W) <= rank
        expected = float((originals[layer.name] - W).norm() / originals[layer.name].norm())
        assert layer.rel_error == pytest.approx(expected, rel=1e-6) and 0 < expected < 1

    # The whole run: at most `ratio` of the parameters, short of it only by the rounding
    # (fewer than 8 ranks per factorised layer), and the model really holds that many.
    factorised = [layer for layer in report.layers if layer.rank is not None]
    assert factorised
    budget = ratio * sum(layer.params for layer in factorised)
    kept = sum(layer.params_kept for layer in factorised)
    slack = sum(8 * sum(layer.shape) for layer in factorised)
    assert budget - slack < kept <= budget
    assert count_params(model) == params_before - report.params + report.params_kept
    assert report.summary()["model_params_after"] == count_params(model)

    logits = model(_inputs()).logits
    assert torch.isfinite(logits).all() and not torch.allclose(logits, dense_logits)


def test_layers_that_would_not_save_stay_dense_and_are_logged(caplog):
    model = make_tiny_model("llama")
    with caplog.at_level(logging.INFO, logger="lmcompress.methods.svd.method"):
        report = compress(model, SVDConfig(ratio=0.5))
    by_name = {layer.name: layer for layer in report.layers}
    k_proj = "model.layers.0.self_attn.k_proj"  # 16x32 at 0.5: rank 5.33 -> 0
    assert by_name[k_proj].rank is None and by_name[k_proj].format is None
    assert type(model.get_submodule(k_proj)) is nn.Linear
    assert any(k_proj in r.getMessage() and "stays dense" in r.getMessage() for r in caplog.records)
    q_proj = "model.layers.0.self_attn.q_proj"  # 32x32 at 0.5: rank 8
    assert by_name[q_proj].rank == 8 and isinstance(model.get_submodule(q_proj), LowRankLinear)
    assert k_proj in report.extra["dense_layers"] and q_proj not in report.extra["dense_layers"]


def test_ratio_one_leaves_the_model_untouched():
    model = make_tiny_model("gpt2")
    before = model(_inputs()).logits
    layers = LayerSelection().select(model)
    report = compress(model, SVDConfig(ratio=1.0))
    assert all(layer.rank is None and layer.format is None for layer in report.layers)
    assert report.params_kept == report.params
    assert all(model.get_submodule(name) is module for name, module in layers.items())
    assert torch.equal(model(_inputs()).logits, before)


def test_include_selects_the_layers():
    model = make_tiny_model("qwen2")
    name = "model.layers.1.mlp.up_proj"
    report = compress(model, SVDConfig(ratio=0.8, include=(name,)))
    assert [layer.name for layer in report.layers] == [name]
    replaced = [n for n, m in model.named_modules() if isinstance(m, LowRankLinear)]
    assert replaced == [name]


@pytest.mark.parametrize("ratio", [0, 0.0, -0.1, 1.5, float("nan"), "abc", True])
def test_bad_ratio_is_a_config_error(ratio):
    with pytest.raises(ConfigError, match="ratio"):
        SVDConfig(ratio=ratio)


def test_ratio_from_a_recipe():
    assert SVDConfig.from_dict({"method": "svd", "ratio": "0.6"}).ratio == 0.6
    with pytest.raises(ConfigError, match="ratio"):
        SVDConfig.from_dict({"ratio": 1.5})


# --- the CLI and export ---------------------------------------------------------------------

TEXT = "\n\n".join(f"Document {i}. The quick brown fox jumps over the lazy dog." for i in range(40))


def _job(checkpoint, corpus):
    return [str(checkpoint), "--method", "svd", "--eval", str(corpus), "--seq-len", "32"]


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    return path


def test_cli_end_to_end(tiny_checkpoint, corpus, tmp_path, capsys):
    out = tmp_path / "out"
    argv = [*_job(tiny_checkpoint, corpus), "--ratio", "0.8", "--eval-tokens", "0", "-o", str(out)]
    assert main([*argv, "-q"]) == 0
    printed = capsys.readouterr().out
    assert "dense ppl" in printed and "compressed ppl" in printed and "svd on " in printed
    manifest = json.loads((out / MANIFEST).read_text())
    compressed = manifest["results"]["compressed"][str(corpus)]["perplexity"]
    assert compressed != manifest["results"]["dense"][str(corpus)]["perplexity"]
    for runtime in ("packed", "dense"):  # the saved model scores what the job reported
        argv = ["eval", str(out), "--data", str(corpus), "--seq-len", "32", "--eval-tokens", "0"]
        assert main([*argv, "--runtime", runtime, "--json", "-q"]) == 0
        scored = json.loads(capsys.readouterr().out)["perplexity"][str(corpus)]["perplexity"]
        assert scored == pytest.approx(compressed, rel=1e-5), runtime


@pytest.mark.parametrize("ratio", ["0", "-0.1", "1.5"])
def test_cli_bad_ratio_is_one_line(tiny_checkpoint, corpus, capsys, ratio):
    assert main([*_job(tiny_checkpoint, corpus), f"--ratio={ratio}", "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert "ratio" in err and len(err.splitlines()) == 1


def test_export_and_reload_by_replay(tmp_path):
    from lmcompress import load_compressed, save_compressed

    model = make_tiny_model("llama")
    report = compress(model, SVDConfig(ratio=0.8))
    logits = model(_inputs()).logits
    out = save_compressed(model, tmp_path / "out", report)
    loaded, _, loaded_report = load_compressed(out, runtime="packed")
    for layer in report.layers:
        module, original = loaded.get_submodule(layer.name), model.get_submodule(layer.name)
        assert isinstance(module, LowRankLinear) and module.rank == layer.rank, layer.name
        for key, value in original.state_tensors().items():
            assert torch.equal(module.state_tensors()[key], value), (layer.name, key)
    assert loaded_report.params_kept == report.params_kept
    with safe_open(str(out / COMPRESSED_TENSORS), framework="pt") as stored:
        factors = [stored.get_slice(k).get_shape() for k in stored.keys() if k[-2:] in (".A", ".B")]
    assert sum(rows * cols for rows, cols in factors) == report.params_kept  # size follows rank
    assert torch.equal(loaded(_inputs()).logits, logits)

    dense, _, _ = load_compressed(out, runtime="dense")
    assert not any(isinstance(m, LowRankLinear) for m in dense.modules())
    assert all(
        in_out_features(dense.get_submodule(layer.name))[::-1] == layer.shape
        for layer in report.layers
    )
    torch.testing.assert_close(dense(_inputs()).logits, logits, rtol=1e-5, atol=1e-5)


def test_cli_ratio_that_compresses_nothing_fails_before_loading(
    tiny_checkpoint, corpus, tmp_path, capsys, monkeypatch
):
    import lmcompress.jobs.run as pipeline

    def never(*_args, **_kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(pipeline, "load_model", never)
    out = tmp_path / "out"
    argv = [*_job(tiny_checkpoint, corpus), "--ratio", "1e-9", "-o", str(out), "-q"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "compress-model: error: --ratio 1e-09 leaves every selected layer dense (each rank "
        "rounds down to 0, ranks being multiples of 8); the smallest ratio that compresses is "
        "0.375 (model.layers.0.mlp.gate_proj, 64x32)"
    )
    assert not out.exists()
