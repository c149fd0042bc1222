"""One-shot structured pruning (``methods/structured``): the budget it is cut to, the scores
against brute force (Wanda-sp's |W|·‖x‖ summed over a structure, the angular distance of
Gromov et al. at the last token), the keep rules, and the whole method: a smaller standard
checkpoint that a fresh process loads without lmcompress, with the job's perplexity."""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys

import pytest
import torch
from conftest import make_tiny_model, make_tiny_tokenizer

from lmcompress import compress, save_compressed
from lmcompress.compressor.model.families import decoder_blocks
from lmcompress.compressor.model.structure import block_shapes, structures_of
from lmcompress.errors import ConfigError
from lmcompress.methods.structured import StructuredConfig
from lmcompress.methods.structured.method import span_keep, top_keep
from lmcompress.methods.structured.scores import (
    SLACK,
    allocate,
    calibration_pass,
    kept_params,
    width_scores,
)

DATA = torch.randint(3, 250, (6, 16), generator=torch.Generator().manual_seed(0))
KINDS = ("heads", "channels", "layers")


def test_allocate_meets_the_budget_in_the_proportions_asked():
    """Every removal of the tiny llama's structures, enumerated: the one chosen is within the
    slack of the closest to the budget, never removes a whole kind, and follows the shares."""
    shapes = block_shapes(make_tiny_model("llama", num_layers=4))
    shape, total = shapes[0], 4 * shapes[0].params
    for kinds in [("channels",), ("heads", "channels"), ("channels", "layers"), KINDS]:
        for ratio in (0.9, 0.75, 0.6):
            removal = allocate(shapes, kinds, ratio)
            ranges = {"channels": range(64), "heads": range(2), "layers": range(4)}
            closest = min(
                abs(kept_params(shape, 4, dict(zip(kinds, r, strict=True))) - ratio * total)
                for r in itertools.product(*(ranges[k] for k in kinds))
            )
            gap = abs(kept_params(shape, 4, removal) - ratio * total)
            assert gap <= closest + SLACK * total
            assert all(removal[k] < len(ranges[k]) for k in kinds)
    assert allocate(shapes, ("channels",), 0.5) == {"channels": 48}  # 0.5 · 9280 / 96 = 48.3
    # channels and blocks: the same fraction of each by default; blocks first when asked
    even = allocate(shapes, ("channels", "layers"), 0.5)
    blocks_first = allocate(shapes, ("channels", "layers"), 0.5, {"channels": 0.1, "layers": 1})
    channels_first = allocate(shapes, ("channels", "layers"), 0.5, {"channels": 1, "layers": 0.1})
    assert blocks_first["layers"] > even["layers"] > channels_first["layers"]
    assert blocks_first["channels"] < even["channels"] < channels_first["channels"]


@pytest.mark.parametrize("multiple", [4, 8])
def test_channel_multiple_keeps_widths_that_are_multiples(multiple):
    """``channel_multiple``: the kept channels a multiple of it at every budget, the closest
    such removal chosen; the default would have kept a width that is not one (the option is
    not a no-op)."""
    shapes = block_shapes(make_tiny_model("llama", num_layers=4))
    shape, total = shapes[0], 4 * shapes[0].params
    channels, free = shape.channels, set()
    fits = [r for r in range(channels) if (channels - r) % multiple == 0]
    for kinds in [("channels",), ("channels", "layers"), KINDS]:
        for ratio in (0.9, 0.75, 0.6):
            removal = allocate(shapes, kinds, ratio, channel_multiple=multiple)
            assert (channels - removal["channels"]) % multiple == 0, (kinds, ratio, removal)
            if kinds == ("channels",):
                best = min(fits, key=lambda r: abs(kept_params(shape, 4, {"channels": r})
                                                   - ratio * total))  # fmt: skip
                assert removal == {"channels": best}
            free.add((channels - allocate(shapes, kinds, ratio)["channels"]) % multiple)
    assert free != {0}


def test_channel_multiple_refusals():
    shapes = block_shapes(make_tiny_model("llama", num_layers=4))
    channels = shapes[0].channels
    with pytest.raises(ConfigError, match=f"no narrower MLP width of the {channels} channels"):
        allocate(shapes, ("channels",), 0.8, channel_multiple=channels)
    with pytest.raises(ConfigError, match=r"\(widths multiples of 32\) keeps 1.000 of"):
        allocate(shapes, ("channels",), 0.9, channel_multiple=32)
    with pytest.raises(ConfigError, match="needs --structure channels"):
        StructuredConfig(structure=("layers",), channel_multiple=32)
    with pytest.raises(ConfigError, match="must be >= 1"):
        StructuredConfig(channel_multiple=0)
    from lmcompress.methods.subnet import SubnetConfig

    with pytest.raises(ConfigError, match="not with --widths per-layer"):
        SubnetConfig(sparsity="0.2", structure=("channels",), widths="per-layer",
                     channel_multiple=32)  # fmt: skip
    with pytest.raises(ConfigError, match="--layer-sample are for a structured extraction"):
        SubnetConfig(sparsity="0.2", channel_multiple=32)


@pytest.mark.parametrize(
    ("kinds", "ratio", "message"),
    [(("heads",), 0.5, "removing whole heads keeps 0.834"), (("layers",), 0.1, "keeps 0.250")],
)
def test_a_budget_whole_structures_cannot_meet_is_refused(kinds, ratio, message):
    shapes = block_shapes(make_tiny_model("llama", num_layers=4))
    with pytest.raises(ConfigError, match=message):
        allocate(shapes, kinds, ratio)


def test_top_keep_and_span_keep():
    scores = torch.tensor([[3.0, 1.0, 2.0, 1.0], [0.0, 5.0, 5.0, 4.0]])
    # ties (the two 1.0 of row 0): the earlier index is kept
    assert top_keep(scores, 1).tolist() == [[True, True, True, False], [False, True, True, True]]
    assert top_keep(scores, 2).tolist() == [[True, False, True, False], [False, True, True, False]]
    assert span_keep(torch.tensor([0.5, 0.2, 0.2, 0.9]), 5, 2).tolist() == [
        True,
        False,
        False,
        True,
        True,
    ]
    assert span_keep(None, 3, 0).all()


def test_the_scores_equal_brute_force():
    """Channel c of block 0: Σ_j |gate_cj|·‖x_j‖ + Σ_j |up_cj|·‖x_j‖ + Σ_i |down_ic|·‖z_c‖
    from the inputs captured whole; KV group g: its q, k, v rows and o columns alike; the
    angular distance across one block at the last token, from the hidden states."""
    model = make_tiny_model("llama", num_layers=3)
    structures = structures_of(model, ())
    kinds = ("heads", "channels", "layers")
    norms, distances = calibration_pass(model, DATA, structures, kinds, 1, batch_size=4)
    scores = width_scores(model, structures, kinds, norms)
    block = decoder_blocks(model)[0]
    inputs = {}
    hooks = [
        m.register_forward_pre_hook(lambda _m, a, n=n: inputs.setdefault(n, []).append(a[0]))
        for n, m in block.named_modules()
        if isinstance(m, torch.nn.Linear)
    ]
    with torch.no_grad():
        hidden = model(DATA, output_hidden_states=True).hidden_states
    for h in hooks:
        h.remove()
    norm = {n: torch.cat(x).reshape(-1, x[0].shape[-1]).norm(dim=0) for n, x in inputs.items()}
    mlp, attn = block.mlp, block.self_attn
    c = 5
    expected = (
        (mlp.gate_proj.weight[c].abs() * norm["mlp.gate_proj"]).sum()
        + (mlp.up_proj.weight[c].abs() * norm["mlp.up_proj"]).sum()
        + mlp.down_proj.weight[:, c].abs().sum() * norm["mlp.down_proj"][c]
    )
    torch.testing.assert_close(scores["channels"][0, c], expected.detach(), rtol=1e-5, atol=0)
    g, rows, kv_rows = 1, slice(16, 32), slice(8, 16)  # 2 query heads of 8 a group
    expected = (
        (attn.q_proj.weight[rows].abs() * norm["self_attn.q_proj"]).sum()
        + (attn.k_proj.weight[kv_rows].abs() * norm["self_attn.k_proj"]).sum()
        + (attn.v_proj.weight[kv_rows].abs() * norm["self_attn.v_proj"]).sum()
        + (attn.o_proj.weight[:, rows].abs().sum(0) * norm["self_attn.o_proj"][rows]).sum()
    )
    torch.testing.assert_close(scores["heads"][0, g], expected.detach(), rtol=1e-5, atol=0)
    cos = torch.nn.functional.cosine_similarity(hidden[0][:, -1], hidden[1][:, -1], dim=-1)
    torch.testing.assert_close(distances[0], (cos.arccos() / math.pi).mean(), rtol=1e-5, atol=1e-6)
    magnitude = width_scores(model, structures, ("channels",), None)["channels"]
    expected = mlp.gate_proj.weight[c].abs().sum() + mlp.up_proj.weight[c].abs().sum()
    expected = expected + mlp.down_proj.weight[:, c].abs().sum()
    torch.testing.assert_close(magnitude[0, c], expected.detach(), rtol=1e-5, atol=0)


def test_the_method_keeps_the_highest_scores_and_the_budget():
    model = make_tiny_model("llama", num_layers=4)
    config = StructuredConfig(structure=("channels", "layers"), ratio=0.7, score="magnitude")
    scores = width_scores(model, structures_of(model, ()), ("channels",), None)["channels"]
    gate = [b.mlp.gate_proj.weight.detach().clone() for b in decoder_blocks(model)]
    report = compress(model, config, DATA)
    removal, removed = report.extra["removal"], report.extra["blocks_removed"]
    assert len(removed) == removal["layers"] == 4 - model.config.num_hidden_layers
    survivors = [i for i in range(4) if i not in removed]
    for new, old in zip(decoder_blocks(model), survivors, strict=True):
        kept = torch.sort(scores[old], descending=True, stable=True).indices[
            : 64 - removal["channels"]
        ]
        assert new.mlp.gate_proj.weight.equal(gate[old][kept.sort().values])
    assert abs(report.extra["kept_fraction"] - 0.7) < 0.05
    kept = sum(p.numel() for b in decoder_blocks(model) for p in b.parameters())
    assert kept == report.extra["decoder_params_kept"]


def test_a_fresh_process_loads_the_export_without_lmcompress(tmp_path):
    model = make_tiny_model("llama", num_layers=3)
    report = compress(model, StructuredConfig(structure=("heads", "channels"), ratio=0.7), DATA)
    out = save_compressed(model, tmp_path / "out", report, tokenizer=make_tiny_tokenizer())
    with torch.no_grad():
        expected = model(DATA[:1]).logits[0, -1].tolist()
    code = (
        "import json, sys, torch, transformers\n"
        f"m = transformers.AutoModelForCausalLM.from_pretrained({str(out)!r}).eval()\n"
        f"ids = torch.tensor({DATA[:1].tolist()})\n"
        "assert not any(k.startswith('lmcompress') for k in sys.modules)\n"
        "print(json.dumps([m.config.num_attention_heads, m.config.intermediate_size,"
        " m(ids).logits[0, -1].tolist()]))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    heads, width, logits = json.loads(result.stdout.strip().splitlines()[-1])
    assert (heads, width) == (model.config.num_attention_heads, model.config.intermediate_size)
    assert heads < 4 and width < 64
    torch.testing.assert_close(torch.tensor(logits), torch.tensor(expected), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"structure": ("rows",)}, "unknown structure 'rows'"),
        ({"structure": ("channels", "channels")}, "each once"),
        ({"ratio": 1.0}, r"must lie in \(0, 1\)"),
        ({"include": ("model.layers.0.*",)}, "no --include"),
    ],
)
def test_bad_options_are_one_line_errors(options, message):
    with pytest.raises(ConfigError, match=message):
        StructuredConfig(**options)


def _kl_from(dense_logits: torch.Tensor, model: torch.nn.Module) -> float:
    with torch.no_grad():
        logits = model(DATA).logits
    p = dense_logits.log_softmax(-1)
    return float((p.exp() * (p - logits.log_softmax(-1))).sum(-1).mean())


def test_distillation_brings_the_extracted_model_closer_to_the_dense_one():
    """The same keeps with and without ``distill_steps``: the distilled extraction has the same
    shapes, other weights, and a lower KL from the dense model on the windows it trained on;
    the dense model itself is untouched by the teacher passes (the deltas are off there)."""
    dense = make_tiny_model("llama", num_layers=3)
    with torch.no_grad():
        dense_logits = dense(DATA).logits
    options = {"structure": ("heads", "channels", "layers"), "ratio": 0.6}
    plain, tuned = make_tiny_model("llama", num_layers=3), make_tiny_model("llama", num_layers=3)
    compress(plain, StructuredConfig(**options), DATA)
    report = compress(tuned, StructuredConfig(**options, distill_steps=30, distill_lr=3e-3), DATA)
    assert [p.shape for p in plain.parameters()] == [p.shape for p in tuned.parameters()]
    assert not all(a.equal(b) for a, b in zip(plain.parameters(), tuned.parameters(), strict=True))
    assert _kl_from(dense_logits, tuned) < 0.8 * _kl_from(dense_logits, plain)
    assert len(report.extra["distill_history"]) == 30
