"""What benchmark jobs run in their own processes (benchmarks/child/), called in process on tiny
models: they score through the library's evaluate step and report what their drivers read."""

import dataclasses

import pytest
import torch
from conftest import make_tiny_model
from safetensors.torch import save_file

from benchmarks.child import int8_interop, lowrank, streaming
from lmcompress.jobs.evaluate import JobText
from lmcompress.jobs.options import RunOptions
from lmcompress.jobs.run import run
from lmcompress.methods.int8 import Int8Config

TEXT = "\n\n".join(f"Document {i}: the quick brown fox jumps over the lazy dog." for i in range(60))


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    return str(path)


def test_int8_interop_scores_transformers_beside_ours(tiny_checkpoint, corpus, tmp_path):
    pytest.importorskip("compressed_tensors")
    out = tmp_path / "out"
    options = RunOptions(checkpoint=str(tiny_checkpoint), eval=(corpus,), seq_len=32)
    run(dataclasses.replace(options, output=str(out), skip_dense=True), Int8Config())
    scores = int8_interop.run(str(out), 0, (corpus,))
    assert set(scores) == {"transformers", "simulated", "runtime"}
    # compressed-tensors' own forward and our simulation of its scheme: the same numbers
    assert scores["transformers"][corpus] == pytest.approx(scores["simulated"][corpus], rel=1e-3)


def test_lowrank_factorise_keeps_the_ratio(tiny_checkpoint, tmp_path):
    model = make_tiny_model("llama")
    spec = {"name": "svd 0.8 uniform", "method": "svd", "ratio": 0.8, "allocation": "uniform"}
    text = JobText(None, RunOptions(checkpoint=str(tiny_checkpoint)), evaluates=False)
    result = lowrank.factorise(model, spec, tmp_path, text)
    assert 0 < result["params_kept_fraction"] <= 0.85 and result["ranks"]


def test_lowrank_variant_rows_factorise_block_by_block(tiny_checkpoint, tmp_path, monkeypatch):
    from lmcompress.methods.svd import SVDLLM, SVDLLMConfig

    data = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(0))
    SVDLLM(SVDLLMConfig()).calibrate(make_tiny_model("llama"), data).save(
        tmp_path / "svd-llm.safetensors"
    )
    text = JobText(None, RunOptions(checkpoint=str(tiny_checkpoint)), evaluates=False)
    monkeypatch.setattr(text, "calibration", lambda: data)
    found = {}
    variants = {None: {}, "sequential+refit": {"sequential": True, "refit": "output"}}
    for variant, options in variants.items():
        spec = {"name": "x", "method": "svd-llm", "ratio": 0.8, "allocation": "greedy",
                "variant": variant, **options}  # fmt: skip
        model = make_tiny_model("llama")
        found[variant] = lowrank.factorise(model, spec, tmp_path, text)
    plain, ours = found[None], found["sequential+refit"]
    assert ours["ranks"] == plain["ranks"]  # the dense statistics allocate them
    assert ours["params_kept_fraction"] == plain["params_kept_fraction"]


def test_streaming_compare_finds_equal_and_different_tensors(tmp_path):
    tensors = {"a": torch.arange(6.0), "b": torch.ones(2, 2)}
    for name in ("left", "right", "other"):
        (tmp_path / name).mkdir()
        changed = {**tensors, "b": torch.zeros(2, 2)} if name == "other" else tensors
        save_file(changed, str(tmp_path / name / "compressed.safetensors"))
    same = streaming.compare_outputs(tmp_path / "left", tmp_path / "right")
    assert same == {
        "tensors": 2, "compressed_tensors": 2, "differ": [], "only_in_one": [], "equal": True
    }  # fmt: skip
    differ = streaming.compare_outputs(tmp_path / "left", tmp_path / "other")
    assert differ["differ"] == ["compressed/b"] and not differ["equal"]


def test_lowrank_residual_row_prunes_the_residual_of_every_factor_pair(
    tiny_checkpoint, tmp_path, monkeypatch
):
    from lmcompress.methods.svd import GFWSVD, GFWSVDConfig

    data = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(0))
    dense_model = make_tiny_model("llama")
    GFWSVD(GFWSVDConfig()).calibrate(dense_model, data).save(tmp_path / "gfwsvd-kfac.safetensors")
    text = JobText(None, RunOptions(checkpoint=str(tiny_checkpoint)), evaluates=False)
    monkeypatch.setattr(text, "calibration", lambda: data)
    spec = {
        "name": "r",
        "method": "gfwsvd",
        "ratio": 0.6,
        "allocation": "uniform",
        "residual": "2:4",
    }
    model = make_tiny_model("llama")
    alone = lowrank.factorise(make_tiny_model("llama"), dict(spec), tmp_path, text)
    found = lowrank.residual_row(model, spec, tmp_path, text)
    factorised = [name for name, rank in found["ranks"].items() if rank is not None]
    assert factorised and found["ranks"] == alone["ranks"]
    share = sum(dense_model.get_submodule(n).weight.numel() for n in factorised) / sum(
        m.weight.numel() for m in lowrank.LayerSelection().select(dense_model).values()
    )
    assert found["params_kept_fraction"] == pytest.approx(alone["params_kept_fraction"] + share / 2)
    for name in factorised:
        layer = model.get_submodule(name)
        residual = layer.residual.weight.reshape(-1, 4)
        assert ((residual != 0).sum(dim=1) <= 2).all()  # 2:4
        W = dense_model.get_submodule(name).weight
        low_rank = layer.low_rank.dense_weight()
        assert (W - low_rank - layer.residual.weight).norm() < (W - low_rank).norm()
