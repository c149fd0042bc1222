"""``--method gptq`` and ``--method rtn`` on the tiny models: every option reaches the solver,
the layers become int4 / nm_packed_int4 modules that export and reload exactly, GPTQ beats
round to nearest, the joint 2:4 mode and a kept earlier mask land at N:M, ``--streaming``
writes what the in-memory run writes, and a pruning recipe then gptq composes."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
import yaml
from conftest import FAMILY_NAMES, make_tiny_model, make_tiny_tokenizer
from safetensors import safe_open

import lmcompress.methods.gptq.method as gptq_method
from lmcompress import (
    GPTQConfig,
    MagnitudeConfig,
    RTNConfig,
    RunOptions,
    compress,
    load_compressed,
    run,
    save_compressed,
)
from lmcompress.cli.main import main
from lmcompress.compressor.formats import grid
from lmcompress.compressor.formats.compose import compose_
from lmcompress.compressor.formats.int4 import Int4Linear, PackedNMInt4Linear
from lmcompress.compressor.io.layout import MANIFEST
from lmcompress.compressor.model.surgery import LayerSelection, weight_matrix

TEXT = "\n\n".join(
    f"Document {i}. The quick brown fox jumps over the lazy dog {i}." for i in range(60)
)
DATA = torch.randint(0, 256, (8, 24), generator=torch.Generator().manual_seed(0))
IDS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))


def _logits(model):
    with torch.no_grad():
        return model(IDS).logits


def test_every_option_reaches_the_solver(monkeypatch):
    calls = []
    real = gptq_method.gptq_quantize

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(gptq_method, "gptq_quantize", spy)
    model = make_tiny_model("llama")
    config = GPTQConfig(
        bits=3, group_size=-1, sym=False, act_order=True, blocksize=24, percdamp=0.05,
        keep_mask=True, sparsity="2:4", hessian_dtype="float64", calib_batch_size=3,
        include=("*.mlp.up_proj",), scale_dtype="float16", observer="mse",
    )  # fmt: skip
    with torch.no_grad():  # up_proj: 2:4 sparse first, for keep_mask
        for name in LayerSelection(config.include).select(model):
            W = weight_matrix(model.get_submodule(name))
            W.mul_(torch.arange(W.shape[1]) % 4 < 2)
    report = compress(model, config, data=DATA)
    assert len(calls) == 2  # the two blocks' up_proj
    args, kwargs = calls[0]
    W, H = args[:2]
    assert args[2:] == (3, -1, False, True, 24, 0.05)
    assert H.dtype == torch.float64 and kwargs["sparsity"] == config.pattern
    assert kwargs["half_scales"] is True and kwargs["mse"] is True
    assert torch.equal(kwargs["mask"], W != 0)
    layer = model.get_submodule("model.layers.0.mlp.up_proj")
    assert isinstance(layer, PackedNMInt4Linear) and (layer.bits, layer.group_size) == (3, -1)
    assert not layer.symmetric and layer.scales.shape == (64, 1)
    assert {x.format for x in report.layers} == {"nm_packed_int4"}
    assert all(x.sparsity == 0.5 and x.pattern == "2:4" for x in report.layers)


@pytest.mark.parametrize(
    ("options", "act_order"),
    [
        ({}, True),  # act-order by default, as llm-compressor's actorder="static"
        ({"act_order": False}, False),
        ({"sparsity": "2:4"}, False),  # the solver chooses the 2:4 mask: in column order
        ({"sparsity": "2:4", "keep_mask": True}, True),  # a fixed mask: act-order again
        ({"sparsity": "0.5"}, True),  # unstructured: chosen per block, any order
    ],
)
def test_act_order_by_default_except_where_the_solver_chooses_nm(options, act_order):
    config = GPTQConfig(group_size=16, **options)
    assert config.act_order is act_order


def test_the_default_act_order_reaches_the_solver_from_the_command_line(
    tiny_checkpoint, tmp_path, monkeypatch
):
    seen = []
    real = gptq_method.gptq_quantize

    def spy(*args, **kwargs):
        seen.append(args[5])
        return real(*args, **kwargs)

    monkeypatch.setattr(gptq_method, "gptq_quantize", spy)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    base = [str(tiny_checkpoint), "--method", "gptq", "--group-size", "16", "--calib",
            str(corpus), "--nsamples", "2", "--seq-len", "16", "--eval", "-q"]  # fmt: skip
    for flags, expected in (([], True), (["--no-act-order"], False)):
        out = tmp_path / f"out-{expected}"
        seen.clear()
        assert main([*base, *flags, "-o", str(out)]) == 0
        assert seen and set(seen) == {expected}
        recorded = json.loads((out / MANIFEST).read_text())["config"]["act_order"]
        assert recorded is expected


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_gptq_exports_and_reloads_exactly_on_every_family(tmp_path, family):
    model = make_tiny_model(family)
    report = compress(model, GPTQConfig(group_size=16, sym=False), data=DATA)
    names = list(LayerSelection().select(make_tiny_model(family)))
    assert [x.name for x in report.layers] == names
    assert all(isinstance(model.get_submodule(n), Int4Linear) for n in names)
    assert all(
        x.bits == 4 and x.format == "int4" and x.error_kind == "output" for x in report.layers
    )
    assert all(0 < x.rel_error < 0.5 for x in report.layers)
    out = save_compressed(model, tmp_path / "out", report, tokenizer=make_tiny_tokenizer())
    packed, _, saved = load_compressed(out, runtime="packed")
    assert torch.equal(_logits(packed), _logits(model))
    assert saved.layers[0].format_options == {"bits": 4, "group_size": 16, "symmetric": False}


@pytest.mark.parametrize("bits", [3, 4])
def test_gptq_is_closer_to_the_dense_model_than_round_to_nearest(bits):
    dense = make_tiny_model("llama")
    errors = {}
    for config in (GPTQConfig(bits=bits, group_size=16), RTNConfig(bits=bits, group_size=16)):
        model = make_tiny_model("llama")
        compress(model, config, data=DATA)
        with torch.no_grad():  # on the windows it calibrated on: what GPTQ minimises
            errors[config.method] = (model(DATA).logits - dense(DATA).logits).norm()
    assert errors["gptq"] < 0.8 * errors["rtn"], errors


@pytest.mark.parametrize(("bits", "sym", "group_size"), [(8, False, -1), (3, True, 32)])
def test_rtn_options_reach_the_layers(bits, sym, group_size):
    model = make_tiny_model("gpt2")  # Conv1D layers
    report = compress(model, RTNConfig(bits=bits, sym=sym, group_size=group_size))
    layer = model.get_submodule(report.layers[0].name)
    assert isinstance(layer, Int4Linear) and layer.conv1d
    assert (layer.bits, layer.symmetric, layer.group_size) == (bits, sym, group_size)
    assert layer.stored_codes().shape[1] == (32 if bits == 8 else 16)
    assert int(layer.weight_codes().max()) <= 2**bits - 1
    assert sym == bool((layer.zeros == 2 ** (bits - 1)).all())
    assert not torch.equal(layer.scales, layer.scales.half().float())  # float32 by default
    half = make_tiny_model("gpt2")
    compress(half, RTNConfig(bits=bits, sym=sym, group_size=group_size, scale_dtype="float16"))
    layer = half.get_submodule(report.layers[0].name)
    assert torch.equal(layer.scales, layer.scales.half().float())


def test_rtn_mse_observer_clips_each_group_by_the_search():
    """``observer="mse"``: each layer's grid is ``grid.group_params(mse=True)`` of its weight
    (narrower than min-max in some groups, never wider); the default stays min-max."""
    names = {}
    for observer in ("minmax", "mse"):
        model = make_tiny_model("llama")
        weights = {n: weight_matrix(m).detach().clone() for n, m in model.named_modules()
                   if n.endswith("mlp.down_proj")}  # fmt: skip
        compress(model, RTNConfig(group_size=16, observer=observer))
        names[observer] = {n: model.get_submodule(n) for n in weights}
    for name, W in weights.items():
        scales, zeros = grid.group_params(W, 4, 16, True, mse=True)
        fitted, plain = names["mse"][name], names["minmax"][name]
        assert torch.equal(fitted.scales, scales) and torch.equal(fitted.zeros, zeros.byte())
        assert (fitted.scales <= plain.scales).all() and (fitted.scales < plain.scales).any()


def test_joint_2_4_prunes_and_quantizes_in_one_pass(tmp_path):
    model = make_tiny_model("qwen2")
    report = compress(model, GPTQConfig(sparsity="2:4", group_size=16), data=DATA)
    for x in report.layers:
        layer = model.get_submodule(x.name)
        assert isinstance(layer, PackedNMInt4Linear) and (layer.n, layer.m) == (2, 4)
        W = layer.dense_weight()
        assert ((W != 0).view(W.shape[0], -1, 4).sum(-1) <= 2).all()
        assert x.sparsity == 0.5 and x.params_kept == W.numel() // 2
    out = save_compressed(model, tmp_path / "out", report, dense_copy=False)
    packed, _, _ = load_compressed(out, runtime="packed")
    assert torch.equal(_logits(packed), _logits(model))


def test_kept_mask_of_an_earlier_stage_composes_to_nm_packed_int4():
    model = make_tiny_model("llama")
    pruned = compress(model, MagnitudeConfig(sparsity="2:4"))
    zeros = {x.name: weight_matrix(model.get_submodule(x.name)) == 0 for x in pruned.layers}
    later = compress(model, GPTQConfig(keep_mask=True, group_size=16), data=DATA)
    report = compose_(model, [pruned, later])
    for x in report.layers:
        layer = model.get_submodule(x.name)
        assert isinstance(layer, PackedNMInt4Linear)
        assert (layer.dense_weight()[zeros[x.name]] == 0).all()
        assert x.format == "nm_packed_int4" and x.extra["stages"] == ["nm_packed", "int4"]


def _checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    make_tiny_model("mistral", num_layers=3).save_pretrained(path, max_shard_size="40KB")
    make_tiny_tokenizer().save_pretrained(path)
    return path


def _tensors(out):
    found = {}
    for file in sorted(out.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            found.update(
                {(file.name == "compressed.safetensors", k): f.get_tensor(k) for k in f.keys()}
            )  # noqa: SIM118
    return found


@pytest.mark.parametrize(
    "config", [GPTQConfig(group_size=16, act_order=True), RTNConfig(group_size=-1, sym=False)]
)
def test_streaming_writes_exactly_the_in_memory_tensors(tmp_path, config):
    checkpoint, corpus = _checkpoint(tmp_path), tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    for name, streaming in (("streamed", True), ("in-memory", False)):
        options = RunOptions(checkpoint=str(checkpoint), calib=str(corpus), eval=(),
                             seq_len=32, nsamples=6, output=str(tmp_path / name),
                             streaming=streaming)  # fmt: skip
        run(options, config)
    got, want = _tensors(tmp_path / "streamed"), _tensors(tmp_path / "in-memory")
    assert sorted(got) == sorted(want) and any(compressed for compressed, _ in want)
    for key in want:
        assert torch.equal(got[key], want[key]), key
    packed = any(key.endswith("weight_packed") for _, key in want)
    assert packed == config.sym  # the dense copy: pack-quantized where it can hold the grid
    configs = [
        json.loads((tmp_path / n / "config.json").read_text()) for n in ("streamed", "in-memory")
    ]
    manifests = [
        json.loads((tmp_path / n / MANIFEST).read_text()) for n in ("streamed", "in-memory")
    ]
    assert configs[0].get("quantization_config") == configs[1].get("quantization_config")
    assert manifests[0]["interop"] == manifests[1]["interop"]
    assert (manifests[1]["interop"] is not None) == packed


@pytest.mark.parametrize(
    ("bits", "sym", "layout"),
    [(4, True, "pack-quantized"), (8, True, "pack-quantized"), (3, True, None), (4, False, None)],
)
def test_the_dense_copy_is_what_vllm_loads_where_the_grid_fits(tmp_path, bits, sym, layout):
    """compress-model's output of GPTQ: its dense copy in compressed-tensors' pack-quantized
    layout (W4A16 / W8A16), which a plain ``from_pretrained`` (compressed-tensors installed)
    loads to our runtime's weights and logits; 3 bits and asymmetric grids, which the layout
    or transformers cannot hold, fall back to the dequantized weights (and still load)."""
    pytest.importorskip("compressed_tensors")
    checkpoint, corpus = _checkpoint(tmp_path), tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    out = tmp_path / "out"
    options = RunOptions(checkpoint=str(checkpoint), calib=str(corpus), eval=(), seq_len=32,
                         nsamples=4, output=str(out))  # fmt: skip
    run(options, GPTQConfig(bits=bits, group_size=16, sym=sym))
    config = json.loads((out / "config.json").read_text()).get("quantization_config")
    assert (config and config["format"]) == layout
    if layout:
        weights = config["config_groups"]["group_0"]["weights"]
        assert (weights["num_bits"], weights["group_size"], weights["symmetric"]) == (bits, 16, sym)
        assert "lm_head" in config["ignore"]
    ours, _, _ = load_compressed(out, runtime="packed")
    plain = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    expected, theirs = _logits(ours), _logits(plain)  # the first forward decompresses
    for name, module in ours.named_modules():
        if isinstance(module, Int4Linear):
            assert torch.equal(plain.get_submodule(name).weight, module.dense_weight()), name
    assert ((theirs - expected).abs().max() / expected.abs().max()).item() <= 1e-5


@pytest.mark.parametrize(
    ("first", "keep_mask"),
    [
        ({"method": "sparsegpt", "sparsity": "2:4"}, True),
        ({"method": "maskllm", "sparsity": "2:4", "steps": 2}, True),  # a learned mask
        ({"method": "sparsegpt", "sparsity": "2:4"}, False),
    ],
)
def test_recipe_pruning_then_gptq(tiny_checkpoint, tmp_path, capsys, first, keep_mask):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    recipe = tmp_path / "recipe.yaml"
    stages = [first, {"method": "gptq", "group_size": 16, "keep_mask": keep_mask}]
    recipe.write_text(yaml.safe_dump({"stages": stages}))
    out = tmp_path / "out"
    argv = ["--config", str(recipe), str(tiny_checkpoint), "--eval", str(corpus), "--calib",
            str(corpus), "--seq-len", "32", "--nsamples", "4", "--eval-tokens", "0", "-o",
            str(out), "-q"]  # fmt: skip
    code = main(argv)
    if not keep_mask:  # gptq would move the zeros: the pruned layers are not its to take
        assert code == 2 and "stage 2 (gptq) has no layer left" in capsys.readouterr().err
        return
    assert code == 0
    layers = json.loads((out / MANIFEST).read_text())["compressed_layers"]
    assert {entry["format"] for entry in layers.values()} == {"nm_packed_int4"}
    model, _, _ = load_compressed(out, runtime="packed")
    W = model.get_submodule(next(iter(layers))).dense_weight()
    assert ((W != 0).view(W.shape[0], -1, 4).sum(-1) <= 2).all()


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_a_quantized_head_has_codes_of_its_own_and_exports(tiny_checkpoint, tmp_path, method):
    """``--head quantized``: the (tied) head becomes an Int4Linear by round to nearest, the
    input embedding keeps its float weight, the export unties them, and the packed runtime and
    the pack-quantized dense copy (the head no longer in ``ignore``) both give the logits."""
    pytest.importorskip("compressed_tensors")
    checkpoint, corpus = tiny_checkpoint, tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    dense = transformers.AutoModelForCausalLM.from_pretrained(checkpoint)
    assert dense.config.tie_word_embeddings
    embedding = dense.get_input_embeddings().weight.detach().clone()
    config = (GPTQConfig if method == "gptq" else RTNConfig)(group_size=16, head="quantized")
    out = tmp_path / "out"
    options = RunOptions(checkpoint=str(checkpoint), calib=str(corpus), eval=(), seq_len=32,
                         nsamples=4, output=str(out))  # fmt: skip
    run(options, config)
    manifest = json.loads((out / MANIFEST).read_text())
    assert "lm_head" in manifest["compressed_layers"]
    ours, _, _ = load_compressed(out, runtime="packed")
    head = ours.get_submodule("lm_head")
    assert isinstance(head, Int4Linear) and head.group_size == 16
    assert not ours.config.tie_word_embeddings
    assert torch.equal(ours.get_input_embeddings().weight, embedding)
    W = embedding.float()
    assert 0 < (head.dense_weight() - W).norm() / W.norm() < 0.2  # quantized, not replaced
    quantization = json.loads((out / "config.json").read_text())["quantization_config"]
    assert "lm_head" not in quantization["ignore"]
    plain = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    expected, theirs = _logits(ours), _logits(plain)
    assert torch.equal(plain.get_submodule("lm_head").weight, head.dense_weight())
    assert ((theirs - expected).abs().max() / expected.abs().max()).item() <= 1e-5


def test_a_quantized_head_cannot_stream(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    argv = [str(_checkpoint(tmp_path)), "--method", "rtn", "--group-size", "16", "--head",
            "quantized", "--streaming", "--eval", "-o", str(tmp_path / "out"), "-q"]  # fmt: skip
    assert main(argv) == 2
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("sparsity", ["none", "2:4"])
def test_a_bfloat16_export_runs_in_every_runtime(tiny_checkpoint, tmp_path, sparsity):
    """``--save-dtype bfloat16`` of a 4-bit output (the layers compressed in fp32): the
    expanded runtime's dense layers come out bf16 like the model (they were fp32: a dtype
    error in the first matmul), equal to the dense runtime's; the packed runtime close."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    out = tmp_path / "out"
    options = RunOptions(checkpoint=str(tiny_checkpoint), calib=str(corpus), eval=(), seq_len=32,
                         nsamples=4, save_dtype="bfloat16", output=str(out))  # fmt: skip
    run(options, GPTQConfig(group_size=16, sparsity=sparsity))
    logits = {}
    for runtime in ("packed", "dense", "expanded"):
        model, _, _ = load_compressed(out, runtime=runtime)
        logits[runtime] = _logits(model)
        assert logits[runtime].dtype == torch.bfloat16
    assert torch.equal(logits["expanded"], logits["dense"])
    torch.testing.assert_close(logits["packed"], logits["dense"], rtol=0.05, atol=0.05)
