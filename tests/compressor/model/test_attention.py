import subprocess
import sys

import pytest
import torch
import transformers
from conftest import make_tiny_model

from lmcompress.compressor.calibration.layerwise import capture_block_inputs
from lmcompress.compressor.model.attention import (
    IMPLEMENTATION,
    attention_hook,
    eager_attention,
    layer_index,
)
from lmcompress.compressor.model.families import family_of
from lmcompress.errors import ConfigError

T = 40  # longer than Gemma3's sliding window (16) in the tiny config


def _ids(n=2, t=T, seed=1):
    return torch.randint(3, 256, (n, t), generator=torch.Generator().manual_seed(seed))


def _eager(model):
    model.set_attn_implementation("eager")
    return model


def _from_config(config):
    config.bos_token_id, config.eos_token_id, config.pad_token_id = 1, 2, 2
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("identity", [False, True])
def test_identity_hook_matches_eager_on_every_family(family_model, identity):
    model_type, model = family_model
    _eager(model)
    ids = _ids()
    with torch.no_grad():
        reference = model(ids).logits
        transform = (lambda _m, p: p) if identity else None
        with attention_hook(model, transform=transform):
            assert model.config._attn_implementation == IMPLEMENTATION
            hooked = model(ids).logits
    _close(hooked, reference)


VARIANTS = {
    # GPT-2's own scaling rules: no 1/sqrt(d), 1/(layer+1), float32 reordered scores.
    "gpt2-unscaled-inverse-layer": lambda: transformers.GPT2Config(
        vocab_size=256,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=128,
        scale_attn_weights=False,
        scale_attn_by_inverse_layer_idx=True,
    ),
    "gpt2-reorder-upcast": lambda: transformers.GPT2Config(
        vocab_size=256,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=128,
        scale_attn_by_inverse_layer_idx=True,
        reorder_and_upcast_attn=True,
    ),
    # A sliding and a global layer; Mistral with a window shorter than the sequence.
    "gemma3-sliding-global": lambda: transformers.Gemma3TextConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
    ),
    "mistral-window-8": lambda: transformers.MistralConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=8,
    ),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_identity_hook_matches_eager_on_variants(variant):
    model = _eager(_from_config(VARIANTS[variant]()))
    ids = _ids()
    with torch.no_grad():
        reference = model(ids).logits
        with attention_hook(model):
            hooked = model(ids).logits
    _close(hooked, reference)


@pytest.mark.parametrize("family", ["llama", "gpt2", "opt"])
def test_identity_hook_matches_eager_with_padding(family):
    model = _eager(make_tiny_model(family))
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[0, :7] = 0  # left padding in the first row
    with torch.no_grad():
        reference = model(ids, attention_mask=mask).logits
        with attention_hook(model):
            hooked = model(ids, attention_mask=mask).logits
    _close(hooked, reference)


def test_observer_reads_causal_probabilities_that_sum_to_one(family_model):
    model_type, model = family_model
    seen = []
    with torch.no_grad(), attention_hook(model) as hook:
        hook.observe = lambda module, probs: seen.append((hook.name(module), module, probs))
        model(_ids())
    blocks = family_of(model).blocks
    assert [layer_index(module) for _, module, _ in seen] == [0, 1]
    assert [name.startswith(f"{blocks}.{i}.") for i, (name, _, _) in enumerate(seen)] == [
        True,
        True,
    ]
    heads = model.config.num_attention_heads
    for _, module, probs in seen:
        assert probs.shape == (2, heads, T, T)
        _close(probs.sum(-1), torch.ones(2, heads, T))
        allowed = torch.ones(T, T, dtype=torch.bool).tril()  # causal: no weight on later tokens
        window = getattr(module, "sliding_window", None)
        if window:  # Gemma3's tiny layers are sliding: nothing older than the window either
            allowed &= ~torch.ones(T, T, dtype=torch.bool).tril(-window)
        assert torch.all(probs[..., ~allowed] == 0) and torch.all(probs[..., allowed] > 0)
    if model_type == "gemma3_text":
        assert all(module.sliding_window == 16 for _, module, _ in seen)


def test_transform_is_in_the_path(family_model):
    """Uniform attention over the causal prefix changes every position but the first (whose
    prefix is one token, so its probabilities were already exactly 1)."""
    model_type, model = family_model
    ids = _ids()

    def uniform(_module, probs):
        causal = torch.ones(probs.shape[-2:]).tril()
        return (causal / causal.sum(-1, keepdim=True)).expand_as(probs)

    with torch.no_grad():
        reference = model(ids).logits
        with attention_hook(model, transform=uniform):
            changed = model(ids).logits
    assert torch.equal(changed[:, 0], reference[:, 0])
    assert (changed[:, 1:] - reference[:, 1:]).abs().amax(-1).min() > 1e-4


def test_observer_sees_softmax_before_transform_and_nested_hooks_compose():
    model = make_tiny_model("llama")
    seen = []
    with torch.no_grad():
        with attention_hook(model, observe=lambda _m, p: seen.append(("outer", p.clone()))):
            with attention_hook(model, transform=lambda _m, p: torch.zeros_like(p)):
                with attention_hook(model, observe=lambda _m, p: seen.append(("inner", p))):
                    model(_ids())
            assert model.config._attn_implementation == IMPLEMENTATION
    assert [tag for tag, _ in seen] == ["outer", "inner"] * 2
    for _, probs in seen:  # both observers saw the softmax, not the zeroed probabilities
        _close(probs.sum(-1), torch.ones(probs.shape[:-1]))


@pytest.mark.parametrize("previous", ["eager", "sdpa"])
def test_implementation_restored_after_block_and_after_error(previous):
    model = make_tiny_model("qwen2")
    model.set_attn_implementation(previous)
    with attention_hook(model):
        pass
    assert model.config._attn_implementation == previous
    calls = []
    with pytest.raises(RuntimeError, match="boom"):
        with attention_hook(model, observe=lambda *_: calls.append(1)):
            model(_ids())
            raise RuntimeError("boom")
    assert model.config._attn_implementation == previous
    assert all(
        m.config._attn_implementation == previous for m in model.modules() if hasattr(m, "config")
    )
    n = len(calls)
    model(_ids())  # no hook left behind, even if a model is set to the implementation by hand
    model.set_attn_implementation(IMPLEMENTATION)
    model(_ids())
    assert n == 2 and len(calls) == n


def test_not_a_transformers_model_is_a_config_error():
    with pytest.raises(ConfigError, match="set_attn_implementation"):
        with attention_hook(torch.nn.Linear(2, 2)):
            pass


def test_registration_is_lazy():
    code = (
        "import lmcompress.compressor.model.attention as a\n"
        "from transformers import AttentionInterface\n"
        "from transformers.masking_utils import AttentionMaskInterface\n"
        "assert a.IMPLEMENTATION not in AttentionInterface._global_mapping\n"
        "a.register()\n"
        "assert a.IMPLEMENTATION in AttentionInterface._global_mapping\n"
        "assert a.IMPLEMENTATION in AttentionMaskInterface._global_mapping\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("capture_impl", ["eager", "sdpa"])
def test_blocks_run_directly_under_the_hook(capture_impl):
    """The layer-wise loop runs blocks on captured inputs: the hook sees them too. Inputs
    captured under sdpa (no mask: sdpa's own is_causal) still give causal attention."""
    model = make_tiny_model("llama")
    model.set_attn_implementation(capture_impl)
    batches = capture_block_inputs(model, _ids(4, 24), batch_size=2, device=torch.device("cpu"))
    blocks = family_of(model).blocks
    layers = model.get_submodule(blocks)
    index = 1
    seen = []
    with torch.no_grad():
        run = [layers[index](b["hidden"], *b["args"][index], **b["kwargs"][index]) for b in batches]
        with attention_hook(model, observe=lambda m, p: seen.append((layer_index(m), p))):
            hooked = [
                layers[index](b["hidden"], *b["args"][index], **b["kwargs"][index]) for b in batches
            ]
    assert [i for i, _ in seen] == [index, index]
    for _, probs in seen:
        assert probs.shape == (2, 4, 24, 24) and torch.all(probs.triu(1) == 0)
    tolerance = 1e-6 if capture_impl == "eager" else 1e-5  # sdpa's kernel rounds differently
    for a, b in zip(hooked, run, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=tolerance)


def test_eager_attention_function_matches_transformers_softcap_and_gqa():
    """The function alone against Gemma3's eager function (softcap, GQA, an additive mask)."""
    from transformers.models.gemma3.modeling_gemma3 import eager_attention_forward

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 6, 8, generator=g) for h in (4, 2, 2))
    mask = torch.zeros(2, 1, 6, 6).masked_fill(torch.rand(2, 1, 6, 6, generator=g) < 0.3, -1e9)
    module = torch.nn.Module()
    module.num_key_value_groups, module.head_dim = 2, 8
    module.eval()
    ref_out, ref_probs = eager_attention_forward(module, q * 3, k * 3, v, mask, softcap=5.0)
    out, probs = eager_attention(module, q * 3, k * 3, v, mask, softcap=5.0)
    _close(out, ref_out)
    _close(probs, ref_probs)
    plain, _ = eager_attention(module, q * 3, k * 3, v, mask)
    assert (plain - out).abs().max() > 1e-3  # the softcap did something


def test_dropout_only_in_training():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 4, generator=g) for _ in range(3))
    module = torch.nn.Module().eval()
    out_eval, _ = eager_attention(module, q, k, v, None, dropout=0.5)
    out_plain, plain = eager_attention(module, q, k, v, None)
    assert torch.equal(out_eval, out_plain)
    module.train()
    torch.manual_seed(0)
    out_train, dropped = eager_attention(module, q, k, v, None, dropout=0.5)
    assert not torch.equal(out_train, out_plain)
    kept = dropped != 0
    assert 0 < kept.sum() < kept.numel()
    _close(dropped[kept], 2 * plain[kept])  # inverted dropout: survivors scaled by 1/(1-p)


@pytest.mark.parametrize("variant", ["llama", "gemma3_text", "gpt2", "gpt2-reorder-upcast"])
def test_identity_hook_matches_eager_in_bfloat16(variant):
    """Half precision shows the dtype rules (float32 softmax, GPT-2's float32 scores)."""
    if variant in VARIANTS:
        model = _from_config(VARIANTS[variant]())
    else:
        model = make_tiny_model(variant)
    model = _eager(model.to(torch.bfloat16))
    ids = _ids()
    with torch.no_grad():
        reference = model(ids).logits
        with attention_hook(model):
            hooked = model(ids).logits
    assert torch.equal(hooked, reference)


def test_a_dropped_model_leaves_no_active_hook_behind():
    """A hook opened for a model's lifetime (an installed transform) must not outlive the model:
    a new module at a dead one's address would otherwise run the dead model's transform."""
    import gc

    from lmcompress.compressor.model.attention import _ACTIVE, open_hook

    before = len(_ACTIVE)
    model = make_tiny_model("llama")
    open_hook(model, transform=lambda _module, probs: probs)
    assert len(_ACTIVE) > before
    del model
    gc.collect()
    assert len(_ACTIVE) == before
