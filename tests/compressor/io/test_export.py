import json

import pytest
import torch
import transformers

from lmcompress import compress, load_compressed, save_compressed
from lmcompress.compressor.io.layout import COMPRESSED_TENSORS, MANIFEST
from lmcompress.errors import LmcompressError, ModelLoadError
from lmcompress.methods.magnitude import MagnitudeConfig


def _compressed(model_type="llama", sparsity="2:4"):
    from conftest import make_tiny_model, make_tiny_tokenizer

    model = make_tiny_model(model_type)
    report = compress(model, MagnitudeConfig(sparsity=sparsity))
    return model, make_tiny_tokenizer(), report


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "opt"])
@pytest.mark.parametrize("sparsity", ["2:4", "0.5"])
def test_round_trip_is_bit_exact_and_plain_transformers_loads_it(tmp_path, model_type, sparsity):
    model, tokenizer, report = _compressed(model_type, sparsity)
    out = save_compressed(model, tmp_path / "out", report, tokenizer=tokenizer)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp dirs left

    loaded, loaded_tok, loaded_report = load_compressed(out)
    assert loaded_report == report
    assert loaded_tok is not None
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key

    plain = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(plain(ids).logits, model(ids).logits, rtol=0, atol=0)

    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["method"] == "magnitude" and manifest["format_version"] == 2
    assert set(manifest["versions"]) >= {"lmcompress", "torch", "transformers"}
    assert (out / COMPRESSED_TENSORS).exists() == (":" in sparsity)


def test_packed_form_is_the_source_of_truth(tmp_path):
    """load_compressed rebuilds pruned layers from the packed values, not the dense copy."""
    from safetensors.torch import load_file, save_file

    model, tokenizer, report = _compressed()
    out = save_compressed(model, tmp_path / "out", report, tokenizer=tokenizer)
    dense = load_file(out / "model.safetensors")
    name = report.layers[0].name
    dense[f"{name}.weight"].fill_(7.0)
    save_file(dense, out / "model.safetensors", metadata={"format": "pt"})
    loaded, _, _ = load_compressed(out)
    assert torch.equal(loaded.get_submodule(name).weight, model.get_submodule(name).weight)


def test_packed_2_4_fp16_is_under_57_percent_of_dense_fp16(tmp_path):
    from safetensors import safe_open

    model, tokenizer, report = _compressed()
    out = save_compressed(model, tmp_path / "out", report, tokenizer=tokenizer, dtype=torch.float16)
    assert next(model.parameters()).dtype == torch.float32  # the caller's model is unchanged
    with safe_open(out / COMPRESSED_TENSORS, framework="pt") as f:
        packed = sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())
    dense_fp16 = sum(layer.params * 2 for layer in report.layers)
    assert packed / dense_fp16 <= 0.57
    loaded, _, _ = load_compressed(out)
    assert next(loaded.parameters()).dtype == torch.float16
    for layer in report.layers:
        expected = model.get_submodule(layer.name).weight.half()
        assert torch.equal(loaded.get_submodule(layer.name).weight, expected)


def test_existing_output_is_refused_then_replaced_atomically(tmp_path):
    model, tokenizer, report = _compressed()
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    with pytest.raises(LmcompressError, match="not empty"):
        save_compressed(model, out, report, tokenizer=tokenizer)
    assert (out / "keep.txt").exists()
    save_compressed(model, out, report, tokenizer=tokenizer, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / MANIFEST).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_failed_save_leaves_nothing(tmp_path, monkeypatch):
    model, tokenizer, report = _compressed()

    def broken(*_args, **_kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("lmcompress.compressor.io.save.save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        save_compressed(model, tmp_path / "out", report, tokenizer=tokenizer)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda out: (out / MANIFEST).unlink(), "not an lmcompress output directory"),
        (lambda out: (out / MANIFEST).write_text("{not json"), "not valid JSON"),
        (lambda out: (out / MANIFEST).write_text('{"format_version": 99}'), "format_version 99"),
        (lambda out: (out / COMPRESSED_TENSORS).write_bytes(b"\x00" * 64), "cannot read"),
    ],
)
def test_corrupt_output_gives_a_clear_error(tmp_path, corrupt, message):
    model, tokenizer, report = _compressed()
    out = save_compressed(model, tmp_path / "out", report, tokenizer=tokenizer)
    corrupt(out)
    with pytest.raises(ModelLoadError, match=message):
        load_compressed(out)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("runtime", ["packed", "dense", "expanded"])
@pytest.mark.parametrize("method", ["magnitude", "svd", "int8"])
def test_every_format_loads_onto_a_gpu(tmp_path, method, runtime):
    """``load_compressed(..., device="cuda")``: the load-time checks and the runtimes on CUDA
    tensors (a packed layer's position check once indexed a CPU table with CUDA codes)."""
    from conftest import make_tiny_model, make_tiny_tokenizer

    from lmcompress import Int8Config, SVDConfig

    config = {
        "magnitude": MagnitudeConfig(sparsity="2:4"),
        "svd": SVDConfig(ratio=0.5),
        "int8": Int8Config(),
    }[method]
    model = make_tiny_model("llama")
    report = compress(model, config)
    out = save_compressed(model, tmp_path / "out", report, tokenizer=make_tiny_tokenizer())
    on_cpu, _, _ = load_compressed(out, runtime=runtime)
    on_gpu, _, _ = load_compressed(out, runtime=runtime, device="cuda")
    assert {p.device.type for p in on_gpu.parameters()} == {"cuda"}
    ids = torch.randint(0, 256, (2, 32))
    expected = on_cpu(ids).logits
    got = on_gpu(ids.cuda()).logits.cpu()
    scale = expected.abs().max().item()
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3 * scale)
