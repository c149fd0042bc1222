"""transformers-native loading of the compact form: after ``import lmcompress``, plain
``AutoModelForCausalLM.from_pretrained`` on an export without the dense copy builds the packed
runtime, identical to ``load_compressed(runtime="packed")``; the default export needs none of it."""

import json
import sys

import pytest
import torch
import transformers
from conftest import make_tiny_model, make_tiny_tokenizer
from safetensors.torch import load_file, save_file
from torch import nn
from transformers.quantizers import auto

from lmcompress import compress, load_compressed, save_compressed
from lmcompress.compressor.formats.base import installed
from lmcompress.compressor.formats.compose import compose_
from lmcompress.compressor.formats.int4 import Int4Linear
from lmcompress.compressor.formats.int8 import QuantLinear
from lmcompress.compressor.formats.int8_softmax import Int8Softmax
from lmcompress.compressor.formats.low_rank import LowRankLinear
from lmcompress.compressor.formats.nm_packed import PackedNMLinear
from lmcompress.compressor.io import hf_registration
from lmcompress.compressor.io.layout import (
    COMPRESSED_TENSORS,
    DENSE_TENSORS,
    MANIFEST,
    QUANT_METHOD,
    WEIGHTS_INDEX,
)
from lmcompress.compressor.io.load import read_manifest
from lmcompress.errors import ModelLoadError
from lmcompress.kernels import cpu_kernels
from lmcompress.methods.gptq import RTNConfig
from lmcompress.methods.int8 import Int8Config
from lmcompress.methods.magnitude import MagnitudeConfig
from lmcompress.methods.svd import SVDConfig

IDS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))


def _export(tmp_path, config, dense_copy=False, dtype=None, family="llama"):
    model = make_tiny_model(family)
    report = compress(model, config, data=torch.randint(0, 256, (4, 16)))
    out = save_compressed(
        model,
        tmp_path / "out",
        report,
        tokenizer=make_tiny_tokenizer(),
        dense_copy=dense_copy,
        dtype=dtype,
    )
    return model, report, out


CASES = {  # config, runtime class, save dtype
    "magnitude-2:4": (MagnitudeConfig(sparsity="2:4"), PackedNMLinear, None),
    "svd": (SVDConfig(ratio=0.5), LowRankLinear, None),
    # bf16 storage with fp32 scales, and a transform (the 8-bit softmax)
    "int8-softmax": (Int8Config(softmax_bits=8), QuantLinear, torch.bfloat16),
    # int4 codes: built on meta in the stored layout, then tiled as load_compressed tiles them
    "rtn-int4": (RTNConfig(bits=4, group_size=16), Int4Linear, None),
}


@pytest.mark.parametrize("case", sorted(CASES))
@torch.no_grad()
def test_from_pretrained_builds_the_packed_runtime_of_load_compressed(tmp_path, case):
    config, runtime_class, dtype = CASES[case]
    _, report, out = _export(tmp_path, config, dtype=dtype)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    ref, _, _ = load_compressed(out, runtime="packed")
    assert hf.config.quantization_config.quant_method == QUANT_METHOD
    layers = read_manifest(out)["compressed_layers"]
    assert len(layers) >= len(report.layers) // 2  # svd keeps layers where rank saves nothing
    for name in layers:
        assert type(hf.get_submodule(name)) is runtime_class, name
        if runtime_class is Int4Linear and cpu_kernels.library() is not None:
            assert hf.get_submodule(name).tiled and ref.get_submodule(name).tiled, name
    hf_state, ref_state = hf.state_dict(), ref.state_dict()
    assert list(hf_state) == list(ref_state)
    for key, value in ref_state.items():
        assert hf_state[key].dtype == value.dtype and torch.equal(hf_state[key], value), key
    if runtime_class is QuantLinear:  # scales stay float32 in a bf16 model
        assert hf.model.layers[0].mlp.down_proj.weight_scale.dtype == torch.float32
        assert hf.dtype == torch.bfloat16
    assert [type(t) for t in installed(hf)] == [type(t) for t in installed(ref)]
    assert (runtime_class is QuantLinear) == bool(installed(hf))
    assert not installed(hf) or isinstance(installed(hf)[0], Int8Softmax)
    assert hf.lm_head.weight is hf.model.embed_tokens.weight  # tied, as in load_compressed
    assert torch.equal(hf(IDS).logits, ref(IDS).logits)


@pytest.mark.parametrize("family", ["gpt2", "gpt_neox"])
@torch.no_grad()
def test_from_pretrained_on_conv1d_and_renamed_checkpoint_keys(tmp_path, family):
    """GPT-2: Conv1D layers, and an _init_weights that reaches for mlp.c_proj.weight;
    GPT-NeoX: a head saved as embed_out that the loader renames."""
    model, _, out = _export(tmp_path, MagnitudeConfig(sparsity="2:4"), family=family)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    layers = read_manifest(out)["compressed_layers"]
    assert layers and all(type(hf.get_submodule(n)) is PackedNMLinear for n in layers)
    assert all(hf.get_submodule(n).conv1d == (family == "gpt2") for n in layers)
    ref, _, _ = load_compressed(out, runtime="packed")
    assert torch.equal(hf(IDS).logits, ref(IDS).logits)
    torch.testing.assert_close(hf(IDS).logits, model(IDS).logits, rtol=1e-5, atol=1e-6)


def test_default_export_loads_with_plain_transformers_without_the_quantizer(tmp_path, monkeypatch):
    model, _, out = _export(tmp_path, MagnitudeConfig(sparsity="2:4"), dense_copy=True)
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and "transformers_weights" not in config
    assert not (out / WEIGHTS_INDEX).exists()
    monkeypatch.delitem(auto.AUTO_QUANTIZER_MAPPING, QUANT_METHOD)
    monkeypatch.delitem(auto.AUTO_QUANTIZATION_CONFIG_MAPPING, QUANT_METHOD)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(hf.model.layers[0].mlp.down_proj) is nn.Linear
    assert getattr(hf, "hf_quantizer", None) is None
    with torch.no_grad():
        torch.testing.assert_close(hf(IDS).logits, model(IDS).logits, rtol=1e-5, atol=1e-6)


def test_compact_export_only_adds_files_that_load_compressed_ignores(tmp_path):
    """The compressed form and the dense parameters are the files they were; the index names
    every stored tensor once."""
    _, report, out = _export(tmp_path, MagnitudeConfig(sparsity="2:4"))
    index = json.loads((out / WEIGHTS_INDEX).read_text())["weight_map"]
    stored = {
        **dict.fromkeys(load_file(out / DENSE_TENSORS), DENSE_TENSORS),
        **dict.fromkeys(load_file(out / COMPRESSED_TENSORS), COMPRESSED_TENSORS),
    }
    assert index == stored
    config = json.loads((out / "config.json").read_text())
    assert config["transformers_weights"] == WEIGHTS_INDEX
    assert (
        config["quantization_config"]["compressed_layers"]
        == read_manifest(out)["compressed_layers"]
    )
    assert len(report.layers) == 14


def _edit_quantization_config(out, edit):
    config = json.loads((out / "config.json").read_text())
    edit(config["quantization_config"])
    (out / "config.json").write_text(json.dumps(config))


def _rename_layer(qc):
    qc["compressed_layers"]["model.layers.9.mlp.up_proj"] = qc["compressed_layers"].pop(
        "model.layers.0.mlp.up_proj"
    )


def _extra_tensor(qc):
    qc["compressed_layers"]["model.layers.0.mlp.up_proj"]["tensors"].append("scales")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_rename_layer, "model.layers.9.mlp.up_proj is not in the llama model"),
        (_extra_tensor, "up_proj.scales is stored in none of the checkpoint files"),
        (lambda qc: qc.update(format_version=99), "unsupported format_version 99"),
        (lambda qc: qc.update(packing="v3"), "unknown keys packing"),
        (lambda qc: qc["compressed_layers"].update(x={"meta": {}}), "malformed compressed_layers"),
    ],
)
def test_a_config_that_does_not_match_the_files_is_a_clear_error(tmp_path, edit, message):
    _, _, out = _export(tmp_path, MagnitudeConfig(sparsity="2:4"))
    _edit_quantization_config(out, edit)
    (out / MANIFEST).unlink()  # the files transformers reads, copied alone (from the Hub)
    with pytest.raises(ModelLoadError, match=message):
        transformers.AutoModelForCausalLM.from_pretrained(out)


def test_loaded_values_are_checked_like_load_compressed(tmp_path):
    _, _, out = _export(tmp_path, Int8Config())
    tensors = load_file(out / COMPRESSED_TENSORS)
    key = "model.layers.0.mlp.up_proj.weight_scale"
    tensors[key] = torch.zeros_like(tensors[key])
    save_file(tensors, out / COMPRESSED_TENSORS)
    for load in (
        lambda: transformers.AutoModelForCausalLM.from_pretrained(out),
        lambda: load_compressed(out, runtime="packed"),
    ):
        with pytest.raises(ModelLoadError, match="weight_scale must be finite and > 0"):
            load()


def test_registration_waits_for_the_registry_import(tmp_path, monkeypatch):
    """``import lmcompress`` does not import transformers' registry; the finder registers right
    after that module's first import (here a stand-in module), once."""
    (tmp_path / "fake_registry.py").write_text("LOADED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(hf_registration, "_REGISTRY", "fake_registry")
    calls = []
    monkeypatch.setattr(
        hf_registration, "_register", lambda: calls.append(sys.modules["fake_registry"].LOADED)
    )
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.delitem(sys.modules, "fake_registry", raising=False)
    hf_registration.install()
    hf_registration.install()  # one finder, not two
    assert (
        calls == []
        and sum(isinstance(f, hf_registration._RegisterAfterImport) for f in sys.meta_path) == 1
    )
    import fake_registry  # noqa: F401

    assert calls == [True]
    assert not any(isinstance(f, hf_registration._RegisterAfterImport) for f in sys.meta_path)
    hf_registration.install()  # already imported: registers at once
    assert calls == [True, True]
    assert auto.AUTO_QUANTIZER_MAPPING[QUANT_METHOD].__name__ == "LmcompressHfQuantizer"


def test_import_lmcompress_imports_neither_transformers_nor_torch():
    import subprocess

    code = "import lmcompress, sys; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"


def _set_codes(tensors, key, edit):
    """The packed 2-bit (2:4) or 4-bit (2:8) position codes of ``key``'s first byte, edited."""
    tensors[key][0, 0] = edit(int(tensors[key][0, 0]))


LAYER = "model.layers.0.mlp.up_proj"
TAMPERED = {  # config, tensor edited, edit, message
    "repeated 2:4 positions": (
        MagnitudeConfig(sparsity="2:4"),
        lambda t: _set_codes(t, f"{LAYER}.indices", lambda byte: (byte & 0xF0) | 0b0101),
        "nm_packed indices: row 0, byte 0: positions \\[1, 1,",
    ),
    "2:8 positions out of range": (
        MagnitudeConfig(sparsity="2:8"),
        lambda t: _set_codes(t, f"{LAYER}.indices", lambda _byte: 0xFF),
        "nm_packed indices: row 0, byte 0: positions \\[15, 15\\]",
    ),
    "nan in nm_packed values": (
        MagnitudeConfig(sparsity="2:4"),
        lambda t: t[f"{LAYER}.values"].view(-1)[3].fill_(float("nan")),
        "nm_packed tensor values holds 1 non-finite value",
    ),
    "inf in a low-rank factor": (
        SVDConfig(ratio=0.5),
        lambda t: t[f"{LAYER}.A"].view(-1)[0].fill_(float("inf")),
        "low_rank tensor A holds 1 non-finite value",
    ),
    "nan in an int8 weight scale": (
        Int8Config(),
        lambda t: t[f"{LAYER}.weight_scale"].view(-1)[2].fill_(float("nan")),
        "int8 weight_scale",
    ),
    "repeated positions in nm_packed_int8": (
        (MagnitudeConfig(sparsity="2:4"), Int8Config()),
        lambda t: _set_codes(t, f"{LAYER}.indices", lambda byte: (byte & 0xF0) | 0b0101),
        "nm_packed_int8 indices: row 0, byte 0: positions \\[1, 1,",
    ),
    "inf in an nm_packed_int8 weight scale": (
        (MagnitudeConfig(sparsity="2:4"), Int8Config()),
        lambda t: t[f"{LAYER}.weight_scale"].view(-1)[0].fill_(float("inf")),
        "nm_packed_int8 weight_scale must be finite and > 0",
    ),
}


def _export_stages(tmp_path, configs):
    """An export of the stages ``configs`` (2:4 then int8: ``nm_packed_int8`` layers)."""
    model = make_tiny_model("llama")
    data = torch.randint(0, 256, (4, 16))
    report = compose_(model, [compress(model, config, data=data) for config in configs])
    return save_compressed(
        model, tmp_path / "out", report, tokenizer=make_tiny_tokenizer(), dense_copy=False
    )


@pytest.mark.parametrize("case", sorted(TAMPERED))
def test_tampered_exports_are_refused_by_every_loader_naming_layer_and_tensor(tmp_path, case):
    """Positions that pack_nm never writes (repeated, out of range) and non-finite weights are
    a ModelLoadError at load, before any forward pass, from load_compressed (both runtimes)
    and from transformers' from_pretrained."""
    config, edit, message = TAMPERED[case]
    if isinstance(config, tuple):
        out = _export_stages(tmp_path, config)
    else:
        _, _, out = _export(tmp_path, config)
    tensors = load_file(out / COMPRESSED_TENSORS)
    edit(tensors)
    save_file(tensors, out / COMPRESSED_TENSORS)
    for load in (
        lambda: transformers.AutoModelForCausalLM.from_pretrained(out),
        lambda: load_compressed(out, runtime="packed"),
        lambda: load_compressed(out, runtime="expanded"),
        lambda: load_compressed(out, runtime="dense"),
    ):
        with pytest.raises(ModelLoadError, match=f"compressed layer {LAYER}: {message}"):
            load()
