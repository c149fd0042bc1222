"""Export in the compressed-tensors ``int-quantized`` layout: a fresh
``AutoModelForCausalLM.from_pretrained`` (compressed-tensors installed) computes what our
simulation of the same W8A8 scheme computes; the files and config follow the layout."""

import json
import math

import pytest
import torch
import transformers
from conftest import make_tiny_model
from safetensors import safe_open
from torch import nn

from lmcompress.compressor.formats.base import CompressedLinear
from lmcompress.compressor.formats.int8 import QuantLinear
from lmcompress.compressor.io.compressed_tensors import simulated_linear, write_compressed_tensors
from lmcompress.compressor.model.surgery import replace_modules
from lmcompress.errors import LmcompressError

pytest.importorskip("compressed_tensors")

STATIC_SCALE = 0.05


class _CtW8A8(CompressedLinear):
    """A QuantLinear's buffers computed by ``simulated_linear``: W8A8 as compressed-tensors
    0.20.1 runs an ``int-quantized`` layer, in float32 (weights ``q · scale``; activations per
    token of a 3-D input, per tensor of a 2-D one (OPT's MLP), ``scale = absmax / 127.5``, or
    the static ``input_scale``; ``round(clamp(x / scale, -128, 127)) · scale``)."""

    def __init__(self, linear: nn.Linear, static: bool, group_size: int | None) -> None:
        W = linear.weight.detach()  # (out, in)
        super().__init__(W.shape[1], W.shape[0])
        q = QuantLinear.from_linear(
            linear,
            activations="static" if static else "dynamic",
            input_scale=STATIC_SCALE if static else None,
            group_size=group_size,
        )
        for name in ("weight_q", "weight_scale", "input_scale", "bias"):
            self.register_buffer(name, getattr(q, name))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return simulated_linear(self, x)


def _decoder_linears(model: nn.Module, only: str = ".layers.") -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and only in n]


def _quantize(model, names, static=lambda _: False, group_size=None, cls=_CtW8A8):
    """Replace ``names`` by W8A8 modules; return ``{name: module}``."""
    if cls is QuantLinear:
        replace_modules(model, names, lambda _, m: QuantLinear.from_linear(m, path="simulated"))
    else:
        replace_modules(model, names, lambda n, m: cls(m, static(n), group_size))
    return {name: model.get_submodule(name) for name in names}


def _export_and_load(model, quantized, tmp_path, **options):
    config = write_compressed_tensors(model, tmp_path, quantized, **options)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    return config, loaded.eval()


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _max_relative(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


IDS = torch.randint(3, 256, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    ("family", "activations", "group_size"),
    [
        ("llama", "dynamic", None),  # tied head, no biases
        ("qwen2", "static", None),  # q/k/v biases, static per-tensor input scales
        ("opt", "dynamic", 8),  # biases, 2-D MLP inputs, per-group weight scales
        ("gemma3_text", "mixed", None),  # two schemes: one config group each
    ],
)
def test_loaded_checkpoint_equals_the_simulated_w8a8(family, activations, group_size, tmp_path):
    model = make_tiny_model(family)
    names = _decoder_linears(model)

    def static(name):
        return activations == "static" or (activations == "mixed" and "mlp" in name)

    quantized = _quantize(model, names, static, group_size)
    config, loaded = _export_and_load(model, quantized, tmp_path)

    groups = config["config_groups"]
    assert len(groups) == (2 if activations == "mixed" else 1)
    strategies = {g["input_activations"]["strategy"] for g in groups.values()}
    assert strategies == {"dynamic": {"token"}, "static": {"tensor"}}.get(
        activations, {"token", "tensor"}
    )
    assert {g["weights"]["group_size"] for g in groups.values()} == {group_size}
    assert _max_relative(_logits(loaded, IDS), _logits(model, IDS)) <= 1e-5  # measured: 0.0


def test_quant_linear_export_matches_its_simulated_path(tmp_path):
    """Our QuantLinear: the loaded weights are its dequantized weights bit for bit; the
    perplexities agree to 1e-4 relative. Logits differ more (measured 3e-3 max relative on this
    model): QuantLinear's dynamic scale is absmax / 127, compressed-tensors' absmax / 127.5."""
    model = make_tiny_model("llama")
    quantized = _quantize(model, _decoder_linears(model), cls=QuantLinear)
    _, loaded = _export_and_load(model, quantized, tmp_path)

    ours, theirs = _logits(model, IDS), _logits(loaded, IDS)
    for name, module in quantized.items():  # decompressed by the first forward
        assert torch.equal(loaded.get_submodule(name).weight, module.dense_weight()), name
    assert _max_relative(theirs, ours) < 2e-2

    def perplexity(logits):
        nll = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), IDS[:, 1:].flatten())
        return math.exp(nll.item())

    assert perplexity(theirs) == pytest.approx(perplexity(ours), rel=1e-4)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_files_follow_the_int_quantized_layout(dtype, tmp_path):
    from compressed_tensors.quantization import QuantizationConfig

    model = make_tiny_model("qwen2")
    quantized = _quantize(model, _decoder_linears(model), lambda n: "mlp" in n)
    config = write_compressed_tensors(model, tmp_path, quantized, dtype=dtype)

    written = json.loads((tmp_path / "config.json").read_text())
    assert written["quantization_config"] == config
    assert written["dtype"] == str(dtype or torch.float32).removeprefix("torch.")
    assert config["quant_method"] == "compressed-tensors"
    assert config["format"] == "int-quantized"
    assert config["quantization_status"] == "compressed"
    assert config["ignore"] == ["lm_head"]
    parsed = QuantizationConfig.model_validate(config)  # compressed-tensors' own schema
    assert sorted(t for g in parsed.config_groups.values() for t in g.targets) == sorted(quantized)

    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        tensors = {key: f.get_tensor(key) for key in f.keys()}
    assert not any(key.endswith(("weight_q", "input_zero_point")) for key in tensors)
    float_dtype = dtype or torch.float32
    for name, module in quantized.items():
        out_features, in_features = module.weight_q.shape
        assert tensors[f"{name}.weight"].dtype == torch.int8
        assert torch.equal(tensors[f"{name}.weight"], module.weight_q)
        assert tensors[f"{name}.weight_scale"].dtype == torch.float32
        assert tensors[f"{name}.weight_scale"].shape == (out_features, 1)
        if "mlp" in name:
            assert tensors[f"{name}.input_scale"].tolist() == [pytest.approx(STATIC_SCALE)]
            assert tensors[f"{name}.input_scale"].dtype == torch.float32
        else:
            assert f"{name}.input_scale" not in tensors
        if module.bias is not None:
            assert tensors[f"{name}.bias"].dtype == float_dtype
    assert tensors["model.embed_tokens.weight"].dtype == float_dtype


def test_layers_left_dense_are_ignored_and_load_unchanged(tmp_path):
    model = make_tiny_model("llama")
    dense_names = _decoder_linears(model, only=".layers.1.")
    dense = {name: model.get_submodule(name).weight.detach().clone() for name in dense_names}
    quantized = _quantize(model, _decoder_linears(model, only=".layers.0."))
    config, loaded = _export_and_load(model, quantized, tmp_path)

    assert config["ignore"] == [*dense_names, "lm_head"]
    assert config["config_groups"]["group_0"]["targets"] == ["Linear"]
    for name, weight in dense.items():
        assert torch.equal(loaded.get_submodule(name).weight, weight), name
    assert _max_relative(_logits(loaded, IDS), _logits(model, IDS)) <= 1e-5


def test_bad_layers_are_one_line_errors(tmp_path):
    gpt2 = make_tiny_model("gpt2")
    conv = QuantLinear.from_linear(gpt2.transformer.h[0].attn.c_attn)
    with pytest.raises(LmcompressError, match="Conv1D"):
        write_compressed_tensors(gpt2, tmp_path, {"transformer.h.0.attn.c_attn": conv})

    model = make_tiny_model("llama")
    layer = QuantLinear.from_linear(model.model.layers[0].mlp.up_proj)
    with pytest.raises(LmcompressError, match="not linear layers of the model: model.nope"):
        write_compressed_tensors(model, tmp_path, {"model.nope": layer})
    with pytest.raises(LmcompressError, match="no quantized layer"):
        write_compressed_tensors(model, tmp_path, {})
    layer.input_scale = torch.zeros(1)
    with pytest.raises(LmcompressError, match="input_scale must be one positive number"):
        write_compressed_tensors(model, tmp_path, {"model.layers.0.mlp.up_proj": layer})
    assert not any(tmp_path.iterdir())  # every check runs before anything is written
