"""``gptq --distill-steps``: the scales trained end to end on the KL from the dense model
(EfficientQAT's E2E-QP), the codes and zero points fixed: the parametrization is the layer's
own dequantized weight (and the dense one switched off), only the scales move, towards the
dense logits, pruned weights stay 0, float16 scales stay float16, the result exports and
reloads exactly, and what cannot run (streaming, a bad step count) is refused."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model
from torch.nn.utils import parametrize
from transformers.pytorch_utils import Conv1D

from lmcompress import GPTQConfig, compress, load_compressed, save_compressed
from lmcompress.cli.main import main
from lmcompress.compressor.formats.int4 import Int4CodedLinear, Int4Linear, PackedNMInt4Linear
from lmcompress.compressor.model.budget import backward_bytes
from lmcompress.errors import ConfigError
from lmcompress.methods import get_method
from lmcompress.methods.gptq.tuning import ScaleWeight

DATA = torch.randint(0, 256, (8, 24), generator=torch.Generator().manual_seed(0))


def _kl_from(dense, model) -> float:
    """KL(dense ‖ model) per position on the calibration windows."""
    with torch.no_grad():
        p = torch.log_softmax(dense(DATA).logits, -1)
        q = torch.log_softmax(model(DATA).logits, -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def _quantized(model) -> dict[str, Int4CodedLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, Int4CodedLinear)}


@pytest.mark.parametrize(
    ("family", "options"),
    [
        ("llama", {"bits": 3, "sym": False}),
        ("gpt2", {"bits": 8, "group_size": 32}),  # Conv1D: the weight stored (in, out)
        ("qwen2", {"sparsity": "2:4"}),  # nm_packed_int4: positions not stored have code z
    ],
)
def test_the_parametrization_is_the_layers_own_weight_and_off_the_dense_one(family, options):
    dense = make_tiny_model(family)
    model = make_tiny_model(family)
    compress(model, GPTQConfig(**{"group_size": 16, **options}), data=DATA)
    for name, layer in _quantized(model).items():
        module = dense.get_submodule(name)
        stored = module.weight.detach().clone()
        weight = ScaleWeight(layer, isinstance(module, Conv1D))
        expected = layer.dense_weight()
        got = weight(stored)
        assert torch.equal(got.T if isinstance(module, Conv1D) else got, expected)
        weight.enabled = False
        assert weight(stored) is stored


def test_only_the_scales_train_towards_the_dense_logits(tmp_path):
    """The same GPTQ codes and zero points as without distillation; other scales, a lower KL
    from the dense model on the windows; the loss curve one entry a step; the quantized layers
    back in place with no parametrization left; and the result exports and reloads exactly."""
    dense, plain, model = (make_tiny_model("llama") for _ in range(3))
    compress(plain, GPTQConfig(group_size=16), data=DATA)
    config = GPTQConfig(group_size=16, distill_steps=24, distill_lr=1e-4)
    report = compress(model, config, data=DATA)
    before, after = _quantized(plain), _quantized(model)
    assert list(after) == list(before) and len(after) == 14
    for name, layer in after.items():
        assert isinstance(layer, Int4Linear)
        assert torch.equal(layer.weight_codes(), before[name].weight_codes())
        assert torch.equal(layer.zeros, before[name].zeros)
        assert layer.scales.dtype == torch.float32 and (layer.scales > 0).all()
    moved = [not torch.equal(a.scales, before[n].scales) for n, a in after.items()]
    assert all(moved)
    assert not any(parametrize.is_parametrized(m) for m in model.modules())
    history = report.extra["distill_history"]
    assert len(history) == 24 and history[0]["kl"] > 0
    assert _kl_from(dense, model) < 0.8 * _kl_from(dense, plain)
    out = save_compressed(model, tmp_path / "out", report, dense_copy=False)
    packed, _, _ = load_compressed(out, runtime="packed")
    with torch.no_grad():
        assert torch.equal(packed(DATA).logits, model(DATA).logits)


def test_pruned_weights_stay_zero_and_float16_scales_stay_float16():
    plain, model = make_tiny_model("qwen2"), make_tiny_model("qwen2")
    options = {"sparsity": "2:4", "group_size": 16, "scale_dtype": "float16"}
    compress(plain, GPTQConfig(**options), data=DATA)
    compress(model, GPTQConfig(**options, distill_steps=8, distill_lr=1e-4), data=DATA)
    before = _quantized(plain)
    for name, layer in _quantized(model).items():
        assert isinstance(layer, PackedNMInt4Linear)
        assert torch.equal(layer.dense_weight() == 0, before[name].dense_weight() == 0)
        assert torch.equal(layer.scales.half().float(), layer.scales)
        assert not torch.equal(layer.scales, before[name].scales)


@pytest.mark.parametrize(("steps", "lr"), [(-1, 1e-5), (4, 0.0), (4, -1e-5)])
def test_bad_distillation_options_are_refused(steps, lr):
    with pytest.raises(ConfigError, match="distill_steps must be >= 0 and distill_lr positive"):
        GPTQConfig(group_size=16, distill_steps=steps, distill_lr=lr)


def test_distillation_cannot_stream(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "out"
    argv = [str(tiny_checkpoint), "--method", "gptq", "--group-size", "16", "--distill-steps",
            "4", "--streaming", "--eval", "-o", str(out), "-q"]  # fmt: skip
    assert main(argv) == 2
    assert "--distill-steps" in capsys.readouterr().err
    assert not out.exists()


def test_the_memory_estimate_counts_the_teacher_and_backward_only_when_distilling():
    model = make_tiny_model("llama")
    plain = get_method("gptq")(GPTQConfig(group_size=16)).memory_estimate(model, 8, 24)
    tuned = get_method("gptq")(GPTQConfig(group_size=16, distill_steps=4))
    parts = tuned.memory_estimate(model, 8, 24)
    numel = sum(m.weight.numel() for m in tuned.validate(model).values())
    assert parts == {
        **plain,
        "dense weights and the codes as bfloat16": 6 * numel,
        "activations kept for backward": backward_bytes(model, 1, 24, 4, 3),
    }
