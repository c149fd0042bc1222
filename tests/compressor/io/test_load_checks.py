"""Tampered exports (issue 39): every stored tensor and manifest field is checked at load, before
any forward pass, against its format's schema; the two manifests agree; the dense part is
checked as the compressed one. Each tampering is refused in one line by ``load_compressed``
(packed and dense runtimes) and by ``compress-model eval`` (exit 2)."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import make_tiny_model, make_tiny_tokenizer

from benchmarks.tamperings import COMPACT, EDITS, LAYER, compact_edit, edit_meta
from lmcompress import Int8Config, SVDConfig, compress, load_compressed, save_compressed
from lmcompress.cli.main import main
from lmcompress.errors import ModelLoadError
from lmcompress.methods.magnitude import MagnitudeConfig

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


MESSAGES = {  # what each tampering's one-line refusal says, on the tiny model
    "2:4 values cast to int32": "nm_packed values is int32, expected a floating dtype",
    "2:4 values relabelled I32": "nm_packed values is int32, expected a floating dtype",
    "int8 weight_scale relabelled I32": "int8 weight_scale is int32, expected float32",
    "2:4 values as float16": "nm_packed values is float16, but the export's dtype is float32",
    "2:4 values as bfloat16": "nm_packed values is bfloat16, but the export's dtype is float32",
    "2:4 values as float64": "nm_packed values is float64, but the export's dtype is float32",
    "low-rank A as float16": "low_rank A is float16, but the export's dtype is float32",
    "low-rank A as int8": "low_rank A is int8, expected a floating dtype",
    "int8 meta.dtype edited": "int8 layer: meta field dtype is 'int32', expected one of float16",
    "low-rank meta.rank removed": "low_rank layer: meta field rank is missing",
    "2:4 meta.n a string": "nm_packed layer: meta field n is '2', expected int",
    "an unlisted tensor": f"holds 1 tensor\\(s\\) the manifest does not list, e.g. {LAYER}.scales",
    "a listed tensor the format does not know": "nm_packed layer: unexpected tensor scales",
    "report removed": "malformed report",
    "report.layers a string": "malformed report",
    "a malformed transform entry": "malformed transform 0",
    "manifest dtype edited": "dtype is 'int8'",
    "hidden_size 640": "q_proj is 32x32, but 32x640 in the model config.json builds",
    "hidden_size not a multiple of the heads": "unreadable config: The hidden size \\(33\\) is not",
    "vocab_size + 1": (
        "model.embed_tokens.weight is \\[256, 32\\] in the dense weights but \\[257, 32\\]"
    ),
    "num_hidden_layers 1": "is not in the llama model",
    "num_hidden_layers + 1": "stored nowhere",
    "model.norm.weight shape [33]": (
        "model.norm.weight is \\[33\\] in the dense weights but \\[32\\] by config.json"
    ),
    "a dense weight NaN": "dense tensor model.norm.weight holds 1 non-finite value",
    "a dense weight missing": "stored nowhere, e.g. model.norm.weight",
    "a dense weight as float16": (
        "dense model.norm.weight is float16, but the export's dtype is float32"
    ),
    "an extra dense tensor": (
        "the dense weights hold 1 tensor\\(s\\) the llama model .* e.g. model.extra.weight"
    ),
}
TAMPERED = {name: (*EDITS[name], message) for name, message in MESSAGES.items()}


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


COMPACT_MESSAGES = {
    "quantization_config: one layer missing": (
        f"disagrees with compression.json on 1 layer\\(s\\), e.g. {LAYER}"
    ),
    "quantization_config: a layer's meta edited": (
        f"disagrees with compression.json on 1 layer\\(s\\), e.g. {LAYER}"
    ),
    "quantization_config: transforms edited": "disagrees with compression.json on the transforms",
    "quantization_config removed": "config.json has no quantization_config",
}


def test_every_tampering_has_a_message():
    assert set(COMPACT_MESSAGES) == set(COMPACT)
    assert set(MESSAGES) == set(EDITS)


@pytest.mark.parametrize("case", sorted(COMPACT_MESSAGES))
def test_the_two_manifests_of_a_compact_export_must_agree(tmp_path, case):
    import transformers

    message = COMPACT_MESSAGES[case]
    out = _export(tmp_path, "2:4", dense_copy=False)
    compact_edit(case)(out)
    loads = [
        lambda: load_compressed(out, runtime="packed"),
        lambda: load_compressed(out, runtime="dense"),
    ]
    if case != "quantization_config removed":  # without it transformers never asks lmcompress
        loads.append(lambda: transformers.AutoModelForCausalLM.from_pretrained(out))
    for load in loads:
        with pytest.raises(ModelLoadError, match=message):
            load()


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
    "case",
    [
        "a dense weight missing",
        "num_hidden_layers + 1",
        "a dense weight NaN",
        "an extra dense tensor",
    ],
)
def test_from_pretrained_refuses_a_dense_part_it_would_initialise_at_random(tmp_path, case):
    import transformers

    kind, edit, _ = TAMPERED[case]
    out = _export(tmp_path, kind, dense_copy=False)
    edit(out)
    message = {
        "a dense weight NaN": "dense tensor model.norm.weight holds 1",
        "an extra dense tensor": "1 tensor\\(s\\) the llama model does not have, e.g. model.extra",
    }.get(case, "stored nowhere")
    with pytest.raises(ModelLoadError, match=message):
        transformers.AutoModelForCausalLM.from_pretrained(out)


@pytest.mark.parametrize("edited", [False, True])
def test_int8_dense_runtime_computes_in_the_exports_dtype(tmp_path, edited):
    """An int8 layer's meta ``dtype`` is the dtype it was compressed at: a float32 model saved
    in bfloat16 (or an edited meta dtype) once gave a dense runtime that failed in its first
    forward (float32 weights, bfloat16 activations)."""
    model = make_tiny_model("llama")
    report = compress(model, Int8Config())
    out = save_compressed(
        model, tmp_path / "out", report, tokenizer=make_tiny_tokenizer(), dtype=torch.bfloat16
    )
    if edited:
        edit_meta(lambda meta: meta.update(dtype="float16"))(out)
    ids = torch.randint(0, 256, (1, 8))
    packed = load_compressed(out, runtime="packed")[0]
    dense = load_compressed(out, runtime="dense")[0]
    assert dense.get_submodule(LAYER).weight.dtype == torch.bfloat16
    with torch.no_grad():
        torch.testing.assert_close(dense(ids).logits, packed(ids).logits, rtol=0.05, atol=0.05)


# transformers' config class refuses this one itself (a ValueError) before any loader runs
NOT_THROUGH_FROM_PRETRAINED = {"hidden_size 640", "hidden_size not a multiple of the heads"}


@pytest.mark.parametrize("case", sorted(set(TAMPERED) - NOT_THROUGH_FROM_PRETRAINED))
def test_from_pretrained_refuses_every_tampering_of_a_compact_export(tmp_path, case):
    """The quantizer route checks what load_compressed checks: compression.json's fields, the
    stored dtypes (a float16 tensor in a float32 export would be cast without a word), the
    dense shapes (else transformers' size-mismatch traceback)."""
    import transformers

    kind, edit, _ = TAMPERED[case]
    out = _export(tmp_path, kind, dense_copy=False)
    edit(out)
    with pytest.raises(ModelLoadError) as info:
        transformers.AutoModelForCausalLM.from_pretrained(out)
    assert "\n" not in str(info.value)


def test_from_pretrained_still_loads_a_float32_export_in_bfloat16(tmp_path):
    """The stored dtypes are compared with the export's, not with the dtype asked for."""
    import transformers

    out = _export(tmp_path, "2:4", dense_copy=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    assert model.get_submodule(LAYER).values.dtype == torch.bfloat16
