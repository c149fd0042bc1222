"""Qwen3 (``model_type="qwen3"``): a Llama-layout family whose attention adds per-head RMS
norms of the queries and keys (``q_norm``/``k_norm``, not linears). The shared tiny families in
``conftest.py`` do not include it, so its checks are here: detection, the layer-wise capture,
the attention hook, one-shot pruning through ``lmcompress.compress``, a job, and the export
round trip."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import VOCAB, make_qwen3, make_tiny_tokenizer

import lmcompress
from lmcompress.cli.main import main
from lmcompress.compressor.calibration.layerwise import compress_layerwise
from lmcompress.compressor.io.layout import MANIFEST
from lmcompress.compressor.model.attention import attention_hook
from lmcompress.compressor.model.families import FAMILIES, decoder_blocks, family_of
from lmcompress.compressor.model.surgery import LayerSelection, weight_matrix
from lmcompress.compressor.report import LayerReport

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CALIB = torch.randint(3, VOCAB, (4, 16), generator=torch.Generator().manual_seed(0))
CONFIGS = {
    "magnitude": lmcompress.MagnitudeConfig(sparsity="2:4"),
    "wanda": lmcompress.WandaConfig(sparsity="2:4"),
    "sparsegpt": lmcompress.SparseGPTConfig(sparsity="2:4", calib_batch_size=2),
}


def test_qwen3_is_detected_and_its_block_linears_selected():
    model = make_qwen3()
    assert model.config.model_type == "qwen3"
    assert family_of(model) is FAMILIES["qwen3"]
    assert len(decoder_blocks(model)) == 2
    names = list(LayerSelection().select(model))
    assert len(names) == 2 * len(LINEARS)
    assert {name.rsplit(".", 1)[-1] for name in names} == set(LINEARS)  # no q_norm/k_norm


def test_layerwise_capture_reproduces_the_models_own_activations():
    """The calibrated methods run block by block: each linear must see exactly the input a
    whole-model forward gives it (rotary position embeddings and the masks included)."""
    model = make_qwen3()
    layers = LayerSelection().select(model)
    expected = {name: [] for name in layers}
    handles = [
        module.register_forward_pre_hook(lambda _m, args, _n=name: expected[_n].append(args[0]))
        for name, module in layers.items()
    ]
    with torch.no_grad():
        model(input_ids=CALIB, use_cache=False)
    for handle in handles:
        handle.remove()
    seen = {name: [] for name in layers}

    class Recorder:
        def __init__(self, name: str) -> None:
            self.name = name

        def add_batch(self, inputs: torch.Tensor) -> None:
            seen[self.name].append(inputs.detach().clone())

    def keep(name, module, _recorder):
        W = weight_matrix(module)
        return LayerReport(name, tuple(W.shape), W.numel(), W.numel(), 0, 0)

    compress_layerwise(
        model, CALIB, layers, lambda name, _m: Recorder(name), keep, batch_size=4, progress=False
    )
    for name in layers:
        torch.testing.assert_close(torch.cat(seen[name]), torch.cat(expected[name]), msg=name)


def test_identity_attention_hook_matches_eager():
    model = make_qwen3()
    model.set_attn_implementation("eager")
    with torch.no_grad():
        reference = model(CALIB).logits
        with attention_hook(model, transform=lambda _m, p: p):
            hooked = model(CALIB).logits
    torch.testing.assert_close(hooked, reference, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_compress_prunes_every_block_linear_exactly_2_of_4(name):
    model = make_qwen3()
    report = lmcompress.compress(model, CONFIGS[name], CALIB)
    layers = LayerSelection().select(model)
    assert report.method == name and [layer.name for layer in report.layers] == list(layers)
    for layer in report.layers:
        W = weight_matrix(layers[layer.name])
        groups = (W != 0).reshape(-1, 4).sum(1)
        assert torch.all(groups <= 2), layer.name  # SparseGPT may zero a kept weight, not more
        assert layer.params_kept == W.numel() // 2 and layer.pattern == "2:4"
    assert report.summary()["params_kept"] == report.params // 2


def test_a_wanda_job_on_a_qwen3_checkpoint_exports_and_reloads(tmp_path):
    """``compress-model`` on a saved Qwen3 checkpoint (preflight on the meta skeleton,
    calibration, evaluation, export), then both runtimes of ``load_compressed`` give the
    model the job wrote."""
    checkpoint, out, corpus = tmp_path / "qwen3", tmp_path / "out", tmp_path / "corpus.txt"
    make_qwen3().save_pretrained(checkpoint)
    make_tiny_tokenizer().save_pretrained(checkpoint)
    corpus.write_text("\n\n".join(f"Document {i}: the quick brown fox." for i in range(40)))
    argv = [str(checkpoint), "--method", "wanda", "--sparsity", "2:4", "--seq-len", "32"]
    argv += ["--eval", str(corpus), "--calib", str(corpus), "--nsamples", "4", "-o", str(out)]
    assert main([*argv, "--eval-tokens", "0", "-q"]) == 0
    manifest = json.loads((out / MANIFEST).read_text())
    assert len(manifest["compressed_layers"]) == 2 * len(LINEARS)
    ppl = manifest["results"]["compressed"][str(corpus)]["perplexity"]
    assert 1 < ppl < float("inf")

    packed, _, report = lmcompress.load_compressed(out, runtime="packed")
    dense, _, _ = lmcompress.load_compressed(out, runtime="dense")
    assert report.method == "wanda" and packed.config.model_type == "qwen3"
    for name in manifest["compressed_layers"]:
        W = dense.get_submodule(name).weight
        assert torch.all((W != 0).reshape(-1, 4).sum(1) <= 2), name
    with torch.no_grad():
        torch.testing.assert_close(packed(CALIB).logits, dense(CALIB).logits)
