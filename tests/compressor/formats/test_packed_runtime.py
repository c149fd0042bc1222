"""PackedNMLinear (the nm_packed format) and the packed runtime: exact round trips, export ->
load by replay on every family, no dense weight of a replaced layer, torch.compile."""

import json

import pytest
import torch
from conftest import FAMILY_NAMES, make_tiny_model, make_tiny_tokenizer
from safetensors.torch import load_file, save_file
from torch import nn
from transformers.pytorch_utils import Conv1D

from lmcompress import compress, load_compressed, save_compressed
from lmcompress.compressor.formats.catalog import format_class
from lmcompress.compressor.formats.low_rank import LowRankLinear
from lmcompress.compressor.formats.nm_packed import PackedNMLinear
from lmcompress.compressor.io.layout import COMPRESSED_TENSORS, DENSE_TENSORS, MANIFEST
from lmcompress.compressor.io.load import runtime_bytes
from lmcompress.compressor.model.surgery import replace_modules, weight_matrix
from lmcompress.compressor.sparsity import nm_mask
from lmcompress.errors import ConfigError, ModelLoadError
from lmcompress.methods.magnitude import MagnitudeConfig


def _sparse_layer(kind, n=2, m=4, bias=True, seed=0):
    torch.manual_seed(seed)
    layer = nn.Linear(24, 12, bias=bias) if kind == "linear" else Conv1D(12, 24)
    with torch.no_grad():
        W = weight_matrix(layer)
        W.mul_(nm_mask(W.abs(), n, m))
    return layer


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
@pytest.mark.parametrize(
    ("n", "m", "bias"), [(2, 4, True), (2, 4, False), (1, 4, True), (4, 8, True)]
)
def test_packed_layer_round_trips_exactly(kind, n, m, bias):
    layer = _sparse_layer(kind, n, m, bias=bias or kind == "conv1d")
    packed = format_class("nm_packed").from_linear(layer, n=n, m=m)
    assert isinstance(packed, PackedNMLinear) and packed.conv1d == (kind == "conv1d")
    assert torch.equal(packed.dense_weight(), weight_matrix(layer))

    rebuilt = PackedNMLinear.from_state(
        packed.state_tensors(), json.loads(json.dumps(packed.meta()))
    )
    for key, value in packed.state_tensors().items():
        assert torch.equal(rebuilt.state_tensors()[key], value), key
    dense = rebuilt.to_dense()
    assert type(dense) is type(layer)
    for key, value in layer.state_dict().items():
        assert torch.equal(dense.state_dict()[key], value), key

    x = torch.randn(3, 5, 24)
    torch.testing.assert_close(packed(x), layer(x), rtol=1e-5, atol=1e-6)


def test_dense_layer_is_refused_and_bad_state_is_a_load_error():
    with pytest.raises(ConfigError, match="not 2:4 sparse"):
        PackedNMLinear.from_linear(nn.Linear(8, 4), n=2, m=4)
    packed = PackedNMLinear.from_linear(_sparse_layer("linear"), n=2, m=4)
    tensors = packed.state_tensors()
    with pytest.raises(ModelLoadError, match="values has shape"):
        PackedNMLinear.from_state({**tensors, "values": tensors["values"][:, :-1]}, packed.meta())
    with pytest.raises(ModelLoadError, match="missing"):
        PackedNMLinear.from_state({"values": tensors["values"]}, packed.meta())


def _export(tmp_path, family="llama", dense_copy=True, **kwargs):
    model = make_tiny_model(family)
    report = compress(model, MagnitudeConfig(sparsity="2:4"))
    out = save_compressed(
        model,
        tmp_path / "out",
        report,
        tokenizer=make_tiny_tokenizer(),
        dense_copy=dense_copy,
        **kwargs,
    )
    return model, report, out


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_packed_runtime_gives_the_dense_runtime_logits_on_every_family(tmp_path, family):
    model, report, out = _export(tmp_path, family)
    packed, tokenizer, _ = load_compressed(out, runtime="packed")
    dense, _, _ = load_compressed(out, runtime="dense")
    assert tokenizer is not None and not packed.training
    for layer in report.layers:
        assert isinstance(packed.get_submodule(layer.name), PackedNMLinear), layer.name
        assert not isinstance(dense.get_submodule(layer.name), PackedNMLinear), layer.name
        assert "weight" not in dict(packed.get_submodule(layer.name).named_parameters())
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        logits = packed(ids).logits
        torch.testing.assert_close(logits, dense(ids).logits, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(logits, model(ids).logits, rtol=1e-5, atol=1e-6)
    if family == "llama":  # tied embeddings: one tensor after the load, as in the original
        assert packed.lm_head.weight is packed.model.embed_tokens.weight


def test_packed_load_never_reads_a_replaced_layers_dense_weight(tmp_path):
    """Poisoned dense weights of the pruned layers in model.safetensors change nothing; the
    layers hold packed bytes only (fp16 storage: 56.25 % of dense fp16)."""
    model, report, out = _export(tmp_path, dtype=torch.float16)
    dense = load_file(out / DENSE_TENSORS)
    for layer in report.layers:
        dense[f"{layer.name}.weight"] = torch.full_like(dense[f"{layer.name}.weight"], torch.nan)
    save_file(dense, out / DENSE_TENSORS, metadata={"format": "pt"})
    packed, _, _ = load_compressed(out, runtime="packed")
    assert not any(torch.isnan(p).any() for p in packed.parameters())
    counted = runtime_bytes(packed)
    assert counted["layers"] == len(report.layers)
    assert counted["ratio_to_dense_fp16"] == pytest.approx(0.5625)
    dense_model, _, _ = load_compressed(out, runtime="dense")
    names = [layer.name for layer in report.layers]
    assert runtime_bytes(dense_model, names)["ratio_to_dense_fp16"] == pytest.approx(1.0)


def test_without_dense_copy_only_uncompressed_parameters_are_written(tmp_path):
    model, report, out = _export(tmp_path, dense_copy=False)
    stored = load_file(out / DENSE_TENSORS)
    names = {layer.name for layer in report.layers}
    assert not any(key.rpartition(".")[0] in names for key in stored)
    assert "model.embed_tokens.weight" in stored and (out / "config.json").is_file()
    assert json.loads((out / MANIFEST).read_text())["dense_copy"] is False
    for runtime in ("packed", "dense"):
        loaded, _, _ = load_compressed(out, runtime=runtime)
        ids = torch.randint(0, 256, (1, 12))
        with torch.no_grad():
            torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-6)
    dense, _, _ = load_compressed(out, runtime="dense")
    for key, value in model.state_dict().items():
        assert torch.equal(dense.state_dict()[key], value), key


def test_a_method_that_replaced_layers_is_stored_as_its_modules(tmp_path):
    """A layer that is already a CompressedLinear (here LowRankLinear) is stored as its own
    tensors whatever the report says; the dense copy holds B @ A, and the model is unchanged."""
    from lmcompress.compressor.report import CompressionReport

    model = make_tiny_model("gpt2")
    names = ["transformer.h.0.mlp.c_fc", "transformer.h.1.attn.c_attn"]
    replace_modules(model, names, lambda _, layer: LowRankLinear.from_linear(layer, rank=8))
    report = CompressionReport(method="test", config={})
    out = save_compressed(model, tmp_path / "out", report, tokenizer=make_tiny_tokenizer())
    assert all(isinstance(model.get_submodule(name), LowRankLinear) for name in names)
    layouts = json.loads((out / MANIFEST).read_text())["compressed_layers"]
    assert {name: entry["format"] for name, entry in layouts.items()} == dict.fromkeys(
        names, "low_rank"
    )
    packed, _, _ = load_compressed(out, runtime="packed")
    dense, _, _ = load_compressed(out, runtime="dense")
    assert isinstance(packed.get_submodule(names[0]), LowRankLinear)
    assert isinstance(dense.get_submodule(names[0]), Conv1D)
    stored = load_file(out / DENSE_TENSORS)
    expected = model.get_submodule(names[0]).dense_weight().t()
    assert torch.equal(stored[f"{names[0]}.weight"], expected)
    ids = torch.randint(0, 256, (2, 10))
    with torch.no_grad():
        for loaded in (packed, dense):
            torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)


def test_version_1_output_still_loads(tmp_path):
    """A version-1 directory (n, m, shape at the top level, no bias stored) loads as before."""
    model, report, out = _export(tmp_path, family="opt")  # OPT's linears have biases
    manifest = json.loads((out / MANIFEST).read_text())
    manifest["format_version"] = 1
    tensors = load_file(out / COMPRESSED_TENSORS)
    for name, entry in manifest["compressed_layers"].items():
        meta = entry["meta"]
        manifest["compressed_layers"][name] = {
            "format": "nm_packed",
            "n": meta["n"],
            "m": meta["m"],
            "shape": [meta["out_features"], meta["in_features"]],
            "tensors": ["indices", "values"],
        }
        del tensors[f"{name}.bias"]
    save_file(tensors, out / COMPRESSED_TENSORS)
    (out / MANIFEST).write_text(json.dumps(manifest))
    packed, _, _ = load_compressed(out, runtime="packed")
    dense, _, _ = load_compressed(out, runtime="dense")
    for key, value in model.state_dict().items():
        assert torch.equal(dense.state_dict()[key], value), key
    ids = torch.randint(0, 256, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(packed(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-6)


def _edit_manifest(out, edit):
    manifest = json.loads((out / MANIFEST).read_text())
    edit(manifest["compressed_layers"])
    (out / MANIFEST).write_text(json.dumps(manifest))


def _first(layers):
    return layers[next(iter(layers))]


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda out: (out / COMPRESSED_TENSORS).unlink(), "cannot read"),
        (lambda out: (out / COMPRESSED_TENSORS).write_bytes(b"\x07" * 64), "cannot read"),
        (lambda out: (out / DENSE_TENSORS).write_bytes(b"\x07" * 64), "cannot read"),
        (lambda out: (out / DENSE_TENSORS).unlink(), "stored nowhere"),
        (
            lambda out: _edit_manifest(out, lambda ls: _first(ls).update(format="int3_magic")),
            "unknown compressed format 'int3_magic'",
        ),
        (
            lambda out: _edit_manifest(out, lambda ls: _first(ls)["tensors"].append("scales")),
            "incomplete",
        ),
        (
            lambda out: _edit_manifest(out, lambda ls: ls.update({"model.nope": _first(ls)})),
            "nope",
        ),
        (lambda out: _edit_manifest(out, lambda ls: _first(ls).pop("meta")), "malformed"),
        (
            lambda out: _edit_manifest(out, lambda ls: _first(ls)["meta"].update(in_features=64)),
            "shape",
        ),
    ],
)
@pytest.mark.parametrize("runtime", ["packed", "dense"])
def test_corrupt_inputs_give_one_line_load_errors(tmp_path, corrupt, message, runtime):
    _, _, out = _export(tmp_path)
    corrupt(out)
    with pytest.raises(ModelLoadError, match=message) as info:
        load_compressed(out, runtime=runtime)
    assert "\n" not in str(info.value)


def test_unknown_runtime_is_a_config_error(tmp_path):
    _, _, out = _export(tmp_path)
    with pytest.raises(ConfigError, match="unknown runtime 'sparse'"):
        load_compressed(out, runtime="sparse")


def test_torch_compile_of_a_packed_llama_matches_eager():
    """fullgraph=True: the op's fake implementation lets Dynamo trace every PackedNMLinear
    (inductor, CPU; one compile of a one-block model, ~10-60 s)."""
    model = make_tiny_model("llama", num_layers=1)
    report = compress(model, MagnitudeConfig(sparsity="2:4"))
    names = [layer.name for layer in report.layers]
    replace_modules(model, names, lambda _, layer: PackedNMLinear.from_linear(layer, n=2, m=4))
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        eager = model(ids).logits
        compiled = torch.compile(model, fullgraph=True)(ids).logits
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


def test_cli_eval_runtimes_agree_and_report_resident_bytes(
    tmp_path, capsys, tiny_checkpoint, caplog
):
    from lmcompress.cli.main import main

    _, report, out = _export(tmp_path, dtype=torch.float16)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(f"word{i} and some text {i}." for i in range(300)))
    results = {}
    for runtime in ("packed", "dense", None):
        argv = ["eval", str(out), "--data", str(corpus), "--seq-len", "32", "--json", "-q"]
        assert main([*argv, *(["--runtime", runtime] if runtime else [])]) == 0
        results[runtime] = json.loads(capsys.readouterr().out)
    ppl = {key: res["perplexity"][str(corpus)]["perplexity"] for key, res in results.items()}
    assert ppl["packed"] == pytest.approx(ppl["dense"], rel=1e-5)
    assert results[None]["load"]["runtime"] == "packed"  # the default for lmcompress outputs
    packed, dense = results["packed"]["load"], results["dense"]["load"]
    assert packed["layers"] == dense["layers"] == len(report.layers)
    assert packed["ratio_to_dense_fp16"] == pytest.approx(0.5625)
    assert dense["ratio_to_dense_fp16"] == pytest.approx(1.0)
    assert 0 < packed["peak_rss_mib"] <= results["packed"]["peak_rss_mib"]

    # A plain checkpoint has no runtime to choose: the flag is ignored with a warning.
    argv = ["eval", str(tiny_checkpoint), "--data", str(corpus), "--seq-len", "32", "--json"]
    assert main([*argv, "--runtime", "packed"]) == 0
    assert "runtime" not in json.loads(capsys.readouterr().out)["load"]
    assert "ignored" in caplog.text
