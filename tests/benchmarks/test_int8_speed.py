"""The int8 speed benchmark (benchmarks/int8_speed.py): its table is drawn from a canned payload,
its profile buckets name where each op's time goes, and the profile of a tiny int8 model puts
the integer matmul and the activation quantization in their own buckets. No real model runs."""

import json

import pytest
import torch
from conftest import make_tiny_model

from benchmarks import int8_speed
from lmcompress.api import compress
from lmcompress.kernels import cpu_kernels
from lmcompress.methods.int8 import Int8Config


def _row(tokens_per_second, first=3.0):
    return {
        "seconds": [4096 / tokens_per_second] * 5,
        "median_seconds": 4096 / tokens_per_second,
        "tokens_per_second": tokens_per_second,
        "first_forward_seconds": first,
    }


PAYLOAD = {
    "settings": {
        "checkpoint": "smollm2-135m",
        "corpus": "wiki-test",
        "batch": 8,
        "seq_len": 512,
        "threads": 2,
        "warmup": 1,
        "repeats": 5,
        "torchao": "0.18.0",
    },
    "machine": {"cpu_count": 2, "torch": "2.13.0+cpu"},
    "runs": [
        {
            "loadavg_before": [4.5, 4.0, 4.0],
            "loadavg_after": [3.5, 4.0, 4.0],
            "rows": {"fp32": _row(200.0), "int8 (ours)": _row(300.0), "torchao": _row(100.0)},
        },
        {
            "loadavg_before": [3.0, 4.0, 4.0],
            "loadavg_after": [2.0, 4.0, 4.0],
            "rows": {"fp32": _row(100.0), "int8 (ours)": _row(160.0), "torchao": _row(50.0)},
        },
    ],
    "profile": {
        "fp32": {"linear (float matmul)": 750.0, "attention (sdpa)": 250.0},
        "int8 (ours)": {"int8 matmul (torch._int_mm)": 300.0, "attention (sdpa)": 200.0},
    },
}


def test_render_gives_tokens_per_second_and_the_ratio_to_fp32_of_each_run():
    md = int8_speed.render(json.loads(json.dumps(PAYLOAD)))
    lines = md.splitlines()
    assert "| fp32 | 200 | 1.00 | 100 | 1.00 | 3.0 |" in lines
    assert "| int8 (ours) | 300 | 1.50 | 160 | 1.60 | 3.0 |" in lines
    assert "| torchao | 100 | 0.50 | 50 | 0.50 | 3.0 |" in lines
    assert "run 1: 4.50 → 3.50, run 2: 3.00 → 2.00" in md
    assert "run 1: 1.50× fp32, 3.00× torchao; run 2: 1.60× fp32, 3.20× torchao." in md
    # the profile table: ms and share of each column's total, the biggest bucket first
    assert "| linear (float matmul) | 750 (75%) | 0 (0%) |" in lines
    assert "| int8 matmul (torch._int_mm) | 0 (0%) | 300 (60%) |" in lines
    assert "| total | 1000 | 500 |" in lines
    assert lines.index("| linear (float matmul) | 750 (75%) | 0 (0%) |") < lines.index(
        "| int8 matmul (torch._int_mm) | 0 (0%) | 300 (60%) |"
    )


def test_render_only_redraws_the_md_from_the_json(tmp_path):
    (tmp_path / "int8_speed.json").write_text(json.dumps(PAYLOAD))
    assert int8_speed.main(["--render-only", "--results-dir", str(tmp_path)]) == 0
    assert (tmp_path / "int8_speed.md").read_text() == int8_speed.render(PAYLOAD)


@pytest.mark.parametrize(
    ("op", "scopes", "expected"),
    [
        ("aten::_int_mm", ("int8 linear", "lmcompress::int8_linear"), "int8 matmul"),
        ("aten::addcmul", ("int8 linear", "lmcompress::int8_linear"), "rescale + bias"),
        ("aten::amax", ("attention", "int8 linear"), "quantize activations"),
        ("aten::mm", ("lm_head", "aten::linear", "aten::matmul"), "lm_head"),
        ("aten::mm", ("mlp", "linear", "aten::linear"), "linear (float matmul)"),
        ("aten::_scaled_dot_product_flash_attention_for_cpu", ("attention",), "attention (sdpa)"),
        ("aten::cat", ("attention",), "rotary embedding"),
        ("aten::silu", ("mlp",), "MLP activation"),
        ("aten::pow", ("norm",), "RMSNorm"),
        ("aten::add", (), "other"),
    ],
)
def test_bucket_puts_each_op_in_its_innermost_module(op, scopes, expected):
    assert expected in int8_speed.bucket(op, scopes)


def test_profile_of_a_tiny_int8_model_separates_int_mm_quantization_and_rescale(monkeypatch):
    """The torch ops of the int8 layers (the compiled CPU kernels off: they are no torch ops),
    then with the kernels, whose time is the layers' own."""
    kernels = cpu_kernels.library()
    monkeypatch.setattr(cpu_kernels, "library", lambda: None)
    model = make_tiny_model("llama")
    ids = torch.randint(3, 200, (2, 16))
    dense = int8_speed.profile(model, ids)
    assert "linear (float matmul)" in dense and "lm_head (fp32 matmul)" in dense
    assert not any("int8" in b or "quantize" in b for b in dense)

    compress(model, Int8Config())
    quantized = int8_speed.profile(model, ids)
    for expected in (
        "int8 matmul (torch._int_mm)",
        "rescale + bias (fp32)",
        "quantize activations (absmax, round, clamp, to int8)",
        "lm_head (fp32 matmul)",
        "attention (sdpa)",
    ):
        assert quantized[expected] > 0, expected
    assert "linear (float matmul)" not in quantized  # every decoder linear is int8
    # the hooks are gone afterwards: a second profile sees no stale scopes
    assert int8_speed.profile(model, ids).keys() == quantized.keys()
    if kernels is not None:
        monkeypatch.setattr(cpu_kernels, "library", lambda: kernels)
        with_kernels = int8_speed.profile(model, ids)
        assert with_kernels[int8_speed.KERNELS] > 0
        assert "rescale + bias (fp32)" not in with_kernels


def test_unknown_rows_are_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        int8_speed.main(["--only", "int4"])
    assert exit_info.value.code == 2
    assert "unknown job(s) int4" in capsys.readouterr().err
