"""Tampered exports (issue 39): every stored tensor and manifest field is checked at load, before
any forward pass, against its format's schema; the two manifests agree; the dense part is
checked as the compressed one. Each tampering is refused in one line by ``load_compressed``
(packed and dense runtimes) and by ``compress-model eval`` (exit 2)."""

from __future__ import annotations

import json
import re
import struct

import pytest
import torch
from conftest import make_tiny_model, make_tiny_tokenizer
from safetensors.torch import load_file, save_file

from lmcompress import Int8Config, SVDConfig, compress, load_compressed, save_compressed
from lmcompress.cli.main import main
from lmcompress.compressor.io.layout import COMPRESSED_TENSORS, DENSE_TENSORS, MANIFEST
from lmcompress.errors import ModelLoadError
from lmcompress.methods.magnitude import MagnitudeConfig

LAYER = "model.layers.0.mlp.up_proj"
CONFIGS = {
    "2:4": MagnitudeConfig(sparsity="2:4"),
    "int8": Int8Config(),
    "svd": SVDConfig(ratio=0.5),
}


def _export(tmp_path, kind, dense_copy=True):
    model = make_tiny_model("llama")
    report = compress(model, CONFIGS[kind])
    return save_compressed(
        model, tmp_path / "out", report, tokenizer=make_tiny_tokenizer(), dense_copy=dense_copy
    )


def _edit_tensors(path, edit):
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _cast(key, dtype, file=COMPRESSED_TENSORS):
    def edit(out):
        _edit_tensors(out / file, lambda t: t.update({key: t[key].to(dtype)}))

    return edit


def _relabel(key, dtype):
    """The same bytes, another dtype in the safetensors header (same element size)."""

    def edit(out):
        path = out / COMPRESSED_TENSORS
        raw = path.read_bytes()
        (length,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + length])
        header[key]["dtype"] = dtype
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (length - len(text))
        assert len(text) == length
        path.write_bytes(raw[:8] + text + raw[8 + length :])

    return edit


def _json(file, edit):
    def apply(out):
        data = json.loads((out / file).read_text())
        edit(data)
        (out / file).write_text(json.dumps(data))

    return apply


def _meta(edit):
    return _json(MANIFEST, lambda m: edit(m["compressed_layers"][LAYER]["meta"]))


def _extra_tensor(listed):
    def edit(out):
        _edit_tensors(out / COMPRESSED_TENSORS, lambda t: t.update({f"{LAYER}.scales": t[
            f"{LAYER}.values"].clone()}))  # fmt: skip
        if listed:
            _json(MANIFEST, lambda m: m["compressed_layers"][LAYER]["tensors"].append("scales"))(
                out
            )

    return edit


def _dense(edit):
    return lambda out: _edit_tensors(out / DENSE_TENSORS, edit)


def _set(data, **fields):
    data.update(fields)


TAMPERED = {  # export, edit, message
    "2:4 values cast to int32": (
        "2:4",
        _cast(f"{LAYER}.values", torch.int32),
        "nm_packed values is int32, expected a floating dtype",
    ),
    "2:4 values relabelled I32": (
        "2:4",
        _relabel(f"{LAYER}.values", "I32"),
        "nm_packed values is int32, expected a floating dtype",
    ),
    "int8 weight_scale relabelled I32": (
        "int8",
        _relabel(f"{LAYER}.weight_scale", "I32"),
        "int8 weight_scale is int32, expected float32",
    ),
    "2:4 values as float16": (
        "2:4",
        _cast(f"{LAYER}.values", torch.float16),
        "nm_packed values is float16, but the export's dtype is float32",
    ),
    "2:4 values as bfloat16": (
        "2:4",
        _cast(f"{LAYER}.values", torch.bfloat16),
        "nm_packed values is bfloat16, but the export's dtype is float32",
    ),
    "2:4 values as float64": (
        "2:4",
        _cast(f"{LAYER}.values", torch.float64),
        "nm_packed values is float64, but the export's dtype is float32",
    ),
    "low-rank A as float16": (
        "svd",
        _cast(f"{LAYER}.A", torch.float16),
        "low_rank A is float16, but the export's dtype is float32",
    ),
    "low-rank A as int8": (
        "svd",
        _cast(f"{LAYER}.A", torch.int8),
        "low_rank A is int8, expected a floating dtype",
    ),
    "int8 meta.dtype edited": (
        "int8",
        _meta(lambda meta: meta.update(dtype="int32")),
        "int8 layer: meta field dtype is 'int32', expected one of float16",
    ),
    "low-rank meta.rank removed": (
        "svd",
        _meta(lambda meta: meta.pop("rank")),
        "low_rank layer: meta field rank is missing",
    ),
    "2:4 meta.n a string": (
        "2:4",
        _meta(lambda meta: meta.update(n="2")),
        "nm_packed layer: meta field n is '2', expected int",
    ),
    "an unlisted tensor": (
        "2:4",
        _extra_tensor(listed=False),
        f"holds 1 tensor\\(s\\) the manifest does not list, e.g. {LAYER}.scales",
    ),
    "a listed tensor the format does not know": (
        "2:4",
        _extra_tensor(listed=True),
        "nm_packed layer: unexpected tensor scales",
    ),
    "report removed": ("2:4", _json(MANIFEST, lambda m: m.pop("report")), "malformed report"),
    "report.layers a string": (
        "2:4",
        _json(MANIFEST, lambda m: m["report"].update(layers="all")),
        "malformed report",
    ),
    "a malformed transform entry": (
        "2:4",
        _json(MANIFEST, lambda m: _set(m, transforms=[{"kind": 3}])),
        "malformed transform 0",
    ),
    "manifest dtype edited": (
        "2:4",
        _json(MANIFEST, lambda m: _set(m, dtype="int8")),
        "dtype is 'int8'",
    ),
    "hidden_size 640": (
        "2:4",
        _json("config.json", lambda c: _set(c, hidden_size=640)),
        "q_proj is 32x32, but 32x640 in the model config.json builds",
    ),
    "vocab_size + 1": (
        "2:4",
        _json("config.json", lambda c: _set(c, vocab_size=c["vocab_size"] + 1)),
        "model.embed_tokens.weight is \\[256, 32\\] in the dense weights but \\[257, 32\\]",
    ),
    "num_hidden_layers 1": (
        "2:4",
        _json("config.json", lambda c: _set(c, num_hidden_layers=1)),
        "is not in the llama model",
    ),
    "num_hidden_layers 3": (
        "2:4",
        _json("config.json", lambda c: _set(c, num_hidden_layers=3)),
        "stored nowhere",
    ),
    "model.norm.weight shape [33]": (
        "2:4",
        _dense(lambda t: t.update({"model.norm.weight": torch.ones(33)})),
        "model.norm.weight is \\[33\\] in the dense weights but \\[32\\] by config.json",
    ),
    "a dense weight NaN": (
        "2:4",
        _dense(lambda t: t["model.norm.weight"].view(-1)[1].fill_(float("nan"))),
        "dense tensor model.norm.weight holds 1 non-finite value",
    ),
    "a dense weight missing": (
        "2:4",
        _dense(lambda t: t.pop("model.norm.weight")),
        "stored nowhere, e.g. model.norm.weight",
    ),
    "a dense weight as float16": (
        "2:4",
        _cast("model.norm.weight", torch.float16, DENSE_TENSORS),
        "dense model.norm.weight is float16, but the export's dtype is float32",
    ),
    "an extra dense tensor": (
        "2:4",
        _dense(lambda t: t.update({"model.extra.weight": torch.ones(3)})),
        "the dense weights hold 1 tensor\\(s\\) the llama model .* e.g. model.extra.weight",
    ),
}


def _tampered(tmp_path, case):
    kind, edit, message = TAMPERED[case]
    out = _export(tmp_path, kind)
    edit(out)
    return out, message


@pytest.mark.parametrize("case", sorted(TAMPERED))
def test_tampered_export_is_one_line_load_error_in_every_runtime(tmp_path, case):
    out, message = _tampered(tmp_path, case)
    for runtime in ("packed", "dense"):
        with pytest.raises(ModelLoadError, match=message) as info:
            load_compressed(out, runtime=runtime)
        assert "\n" not in str(info.value), runtime


@pytest.mark.parametrize("case", sorted(TAMPERED))
def test_tampered_export_is_exit_2_from_compress_model_eval(tmp_path, case, capsys):
    out, message = _tampered(tmp_path, case)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"Document {i}. The quick brown fox." for i in range(40)))
    capsys.readouterr()  # the export's progress bars
    assert main(["eval", str(out), "--data", str(corpus), "--seq-len", "16", "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert re.search(message, err), err


COMPACT = {  # edit of config.json's quantization_config, message
    "one layer missing": (
        lambda qc: qc["compressed_layers"].pop(LAYER),
        f"disagrees with compression.json on 1 layer\\(s\\), e.g. {LAYER}",
    ),
    "a layer's meta edited": (
        lambda qc: qc["compressed_layers"][LAYER]["meta"].update(n=1),
        f"disagrees with compression.json on 1 layer\\(s\\), e.g. {LAYER}",
    ),
    "transforms edited": (
        lambda qc: qc.update(transforms=[{"kind": "int8_softmax", "meta": {}, "tensors": []}]),
        "disagrees with compression.json on the transforms",
    ),
}


@pytest.mark.parametrize("case", sorted(COMPACT))
def test_the_two_manifests_of_a_compact_export_must_agree(tmp_path, case):
    import transformers

    edit, message = COMPACT[case]
    out = _export(tmp_path, "2:4", dense_copy=False)
    _json("config.json", lambda c: edit(c["quantization_config"]))(out)
    for load in (
        lambda: load_compressed(out, runtime="packed"),
        lambda: load_compressed(out, runtime="dense"),
        lambda: transformers.AutoModelForCausalLM.from_pretrained(out),
    ):
        with pytest.raises(ModelLoadError, match=message):
            load()


def test_a_compact_export_without_its_quantization_config_is_refused(tmp_path):
    out = _export(tmp_path, "2:4", dense_copy=False)
    _json("config.json", lambda c: c.pop("quantization_config"))(out)
    with pytest.raises(ModelLoadError, match="config.json has no quantization_config"):
        load_compressed(out, runtime="packed")


@pytest.mark.parametrize(
    "case", ["2:4 values cast to int32", "int8 weight_scale relabelled I32", "low-rank A as int8"]
)
def test_from_pretrained_refuses_retyped_compressed_tensors(tmp_path, case):
    """A compact export read by transformers' loader (the quantizer): the stored dtype is
    checked before the loader would cast an integer tensor into a float parameter."""
    import transformers

    kind, edit, message = TAMPERED[case]
    out = _export(tmp_path, kind, dense_copy=False)
    edit(out)
    with pytest.raises(ModelLoadError, match=message):
        transformers.AutoModelForCausalLM.from_pretrained(out)


@pytest.mark.parametrize(
    "case",
    ["2:4 values cast to int32", "2:4 values relabelled I32", "int8 weight_scale relabelled I32"],
)
def test_bench_refuses_what_it_once_timed_silently(tmp_path, tiny_checkpoint, case, capsys):
    out, message = _tampered(tmp_path, case)
    capsys.readouterr()
    argv = ["bench", str(tiny_checkpoint), str(out), "--prefill", "2x16", "--decode", "2"]
    argv += ["--prompt", "4", "--repeats", "1", "--warmup", "0", "-o", str(tmp_path / "s"), "-q"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(message, err), err


@pytest.mark.parametrize(
    "case", ["a dense weight missing", "num_hidden_layers 3", "a dense weight NaN"]
)
def test_from_pretrained_refuses_a_dense_part_it_would_initialise_at_random(tmp_path, case):
    import transformers

    kind, edit, _ = TAMPERED[case]
    out = _export(tmp_path, kind, dense_copy=False)
    edit(out)
    message = "dense tensor model.norm.weight holds 1" if "NaN" in case else "stored nowhere"
    with pytest.raises(ModelLoadError, match=message):
        transformers.AutoModelForCausalLM.from_pretrained(out)


@pytest.mark.parametrize("edit_meta", [False, True])
def test_int8_dense_runtime_computes_in_the_exports_dtype(tmp_path, edit_meta):
    """An int8 layer's meta ``dtype`` is the dtype it was compressed at: a float32 model saved
    in bfloat16 (or an edited meta dtype) once gave a dense runtime that failed in its first
    forward (float32 weights, bfloat16 activations)."""
    model = make_tiny_model("llama")
    report = compress(model, Int8Config())
    out = save_compressed(
        model, tmp_path / "out", report, tokenizer=make_tiny_tokenizer(), dtype=torch.bfloat16
    )
    if edit_meta:
        _meta(lambda meta: meta.update(dtype="float16"))(out)
    ids = torch.randint(0, 256, (1, 8))
    packed = load_compressed(out, runtime="packed")[0]
    dense = load_compressed(out, runtime="dense")[0]
    assert dense.get_submodule(LAYER).weight.dtype == torch.bfloat16
    with torch.no_grad():
        torch.testing.assert_close(dense(ids).logits, packed(ids).logits, rtol=0.05, atol=0.05)
