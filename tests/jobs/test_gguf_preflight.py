"""``--export gguf`` is refused before any weight is read when GGUF cannot hold the result: the
family, a stage that stores its layers in another format, a grid Q4_0/Q8_0 do not hold."""

from __future__ import annotations

import pytest
import transformers

from lmcompress.compressor.model import loading
from lmcompress.errors import ConfigError
from lmcompress.jobs.options import RunOptions
from lmcompress.jobs.recipe import check_gguf, grid_of
from lmcompress.jobs.run import run
from lmcompress.methods.int8 import Int8Config
from lmcompress.methods.magnitude import MagnitudeConfig

TEXT = "\n\n".join(f"Document {i}: the quick brown fox jumps over the lazy dog." for i in range(40))
LLAMA = transformers.LlamaConfig()


class _Grid:
    """A stage config of a weight-only low-bit method (its ``bits``, ``group_size``, ``sym``)."""

    def __init__(self, bits=4, group_size=32, sym=True):
        self.bits, self.group_size, self.sym = bits, group_size, sym


@pytest.mark.parametrize(
    ("stored", "grid", "message"),
    [
        (["int4"], _Grid(3), "not 3-bit"),
        (["int4"], _Grid(4, 128), "needs --group-size 32"),
        (["int4"], _Grid(4, 32, False), "symmetric"),
        (["nm_packed"], None, "stored as nm_packed"),
        ([None], None, "stored as a dense weight"),
        (["low_rank"], None, "stored as low_rank"),
        (["int8"], None, "stored as int8"),
    ],
)
def test_what_gguf_cannot_hold_is_refused(stored, grid, message):
    grids = {"model.layers.0.mlp.up_proj": grid_of(grid) if grid else None}
    with pytest.raises(ConfigError, match=message):
        check_gguf(LLAMA, {"model.layers.0.mlp.up_proj": stored}, grids)


@pytest.mark.parametrize("stored", [["int4"], ["nm_packed", "int4"], ["nm_packed_int4"]])
@pytest.mark.parametrize("bits", [4, 8])
def test_symmetric_group_32_low_bit_layers_pass(stored, bits):
    grids = {"model.layers.0.mlp.up_proj": grid_of(_Grid(bits))}
    check_gguf(LLAMA, {"model.layers.0.mlp.up_proj": stored}, grids)


def test_other_families_are_refused():
    with pytest.raises(ConfigError, match="not gpt2"):
        check_gguf(transformers.GPT2Config(), {"x": ["int4"]}, {"x": grid_of(_Grid())})


@pytest.mark.parametrize("config", [MagnitudeConfig(), Int8Config()])
def test_a_job_is_refused_before_the_model_loads(config, tiny_checkpoint, tmp_path, monkeypatch):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)

    def no_load(*args, **kwargs):  # noqa: ARG001
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(loading, "load_model", no_load)
    monkeypatch.setattr("lmcompress.jobs.run.load_model", no_load)
    options = RunOptions(
        checkpoint=str(tiny_checkpoint), calib=str(corpus), eval=(str(corpus),), seq_len=32,
        nsamples=4, eval_tokens=0, export="gguf", output=str(tmp_path / "out"),
    )  # fmt: skip
    with pytest.raises(ConfigError, match="--export gguf writes weight-only"):
        run(options, config)
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_gguf_cannot_hold_is_refused_before_the_model_loads(
    tiny_checkpoint, tmp_path, monkeypatch
):
    """The tiny checkpoint's tokenizer is a byte WordLevel one: no tokenizer.ggml form."""
    from lmcompress.methods.gptq import RTNConfig

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    monkeypatch.setattr("lmcompress.jobs.run.load_model", None)  # called: a TypeError
    options = RunOptions(
        checkpoint=str(tiny_checkpoint), calib=str(corpus), eval=(str(corpus),), seq_len=32,
        nsamples=4, eval_tokens=0, export="gguf", output=str(tmp_path / "out"),
    )  # fmt: skip
    with pytest.raises(ConfigError, match="byte-level BPE tokenizers"):
        run(options, RTNConfig(bits=4, group_size=32))


def test_a_job_writes_the_gguf_transformers_loads(tmp_path):
    """``compress-model CKPT --method rtn --bits 4 --group-size 32 --export gguf -o OUT`` through
    ``run``: OUT/model.gguf beside the export; transformers' GGUF loader gives the runtime's
    weights with the scales rounded to float16 (RTN's are float32)."""
    import json

    import torch
    from compressor.io.test_gguf_export import _bpe_tokenizer, _llama

    from lmcompress.compressor.io.load import load_compressed
    from lmcompress.methods.gptq import RTNConfig

    checkpoint = tmp_path / "ckpt"
    _llama().save_pretrained(checkpoint)
    _bpe_tokenizer().save_pretrained(checkpoint)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    options = RunOptions(
        checkpoint=str(checkpoint), calib=str(corpus), eval=(str(corpus),), seq_len=32,
        nsamples=4, eval_tokens=0, export="gguf", output=str(tmp_path / "out"),
    )  # fmt: skip
    results = run(options, RTNConfig(bits=4, group_size=32))
    out = tmp_path / "out"
    assert results["gguf"]["tensor_types"]["Q4_0"] == 14
    assert 0 < results["gguf"]["scale_fp16_max_relative_change"] <= 2**-11
    assert json.loads((out / "compression.json").read_text())["results"]["gguf"]
    ours, _, _ = load_compressed(out, runtime="packed")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        out, gguf_file="model.gguf", dtype=torch.float32
    )
    layer = ours.model.layers[0].mlp.down_proj
    codes = layer.weight_codes().float().view(layer.out_features, -1, 32)
    W = (codes - layer.zeros.float().unsqueeze(-1)) * layer.scales.half().float().unsqueeze(-1)
    assert torch.equal(loaded.model.layers[0].mlp.down_proj.weight, W.flatten(1))


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_float16_scales_make_the_gguf_exact(tmp_path, method):
    """``--scale-dtype float16`` (RTN and GPTQ): every scale a float16 number fitted before the
    codes, so the GGUF records no rounding (0.0) and transformers' GGUF loader gives the
    runtime's weights bit for bit; the default float32 scales are rounded (> 0)."""
    import json

    import torch
    from compressor.io.test_gguf_export import _bpe_tokenizer, _llama

    from lmcompress.compressor.formats.int4 import Int4Linear
    from lmcompress.compressor.io.load import load_compressed
    from lmcompress.methods import METHODS

    checkpoint = tmp_path / "ckpt"
    _llama().save_pretrained(checkpoint)
    _bpe_tokenizer().save_pretrained(checkpoint)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    config_class = METHODS[method].config_class
    changes = {}
    for scale_dtype in ("float16", "float32"):
        out = tmp_path / scale_dtype
        options = RunOptions(
            checkpoint=str(checkpoint), calib=str(corpus), eval=(), seq_len=32, nsamples=4,
            export="gguf", output=str(out),
        )  # fmt: skip
        results = run(options, config_class(bits=4, group_size=32, scale_dtype=scale_dtype))
        changes[scale_dtype] = results["gguf"]["scale_fp16_max_relative_change"]
        manifest = json.loads((out / "compression.json").read_text())
        assert manifest["config"]["scale_dtype"] == scale_dtype
    assert changes["float16"] == 0.0 and 0 < changes["float32"] <= 2**-11
    out = tmp_path / "float16"
    ours, _, _ = load_compressed(out, runtime="packed")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        out, gguf_file="model.gguf", dtype=torch.float32
    )
    layers = [(n, m) for n, m in ours.named_modules() if isinstance(m, Int4Linear)]
    assert len(layers) == 14
    for name, layer in layers:
        assert torch.equal(layer.scales, layer.scales.half().float()), name
        assert torch.equal(loaded.get_submodule(name).weight, layer.dense_weight()), name


def test_a_quantized_head_is_the_gguf_output_tensor(tmp_path):
    """``--head quantized`` with ``--export gguf``: the untied head is written as ``output``
    in Q4_0 beside the float embedding, and the GGUF's model computes our logits exactly."""
    import torch
    from compressor.io.test_gguf_export import _bpe_tokenizer, _llama

    from lmcompress.compressor.io.load import load_compressed
    from lmcompress.methods.gptq import RTNConfig

    checkpoint = tmp_path / "ckpt"
    _llama().save_pretrained(checkpoint)
    _bpe_tokenizer().save_pretrained(checkpoint)
    options = RunOptions(checkpoint=str(checkpoint), eval=(), seq_len=32, export="gguf",
                         output=str(tmp_path / "out"))  # fmt: skip
    config = RTNConfig(bits=4, group_size=32, head="quantized", scale_dtype="float16")
    results = run(options, config)
    assert results["gguf"]["tensor_types"] == {"F32": 6, "Q4_0": 15}  # 14 + the head
    ours, _, _ = load_compressed(tmp_path / "out", runtime="packed")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", gguf_file="model.gguf", dtype=torch.float32
    ).eval()
    assert torch.equal(loaded.lm_head.weight, ours.lm_head.dense_weight())
    assert torch.equal(loaded.model.embed_tokens.weight, ours.model.embed_tokens.weight)
    # more tokens than the int4 decode kernel takes: the dequantized weights' matmul, exactly
    ids = torch.randint(3, 200, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, ours(ids).logits)
