"""The lean decode step (``compressor/lean_decode.py``, ``kernels/lean_step.py``): each
kernel against the transformers code it replaces, whole steps against transformers' eager step
(dense and int4 layers, fp32 and bf16, GQA), and the calls it must leave to the model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from conftest import count_calls, make_tiny_model, requires_kernels
from transformers import DynamicCache
from transformers.models.llama import modeling_llama

from lmcompress import compress
from lmcompress.compressor import lean_decode
from lmcompress.compressor.formats import int4_lean
from lmcompress.compressor.formats.int4_shared import prepare_decode
from lmcompress.compressor.lean_decode import LeanDecoder
from lmcompress.kernels import lean_step
from lmcompress.methods.gptq import RTNConfig

pytestmark = requires_kernels
DTYPES = [torch.float32, torch.bfloat16]


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_is_transformers_rotary_bit_for_bit(dtype):
    config = make_tiny_model("llama").config
    rotary = modeling_llama.LlamaRotaryEmbedding(config)
    q = torch.randn(1, 4, 1, 8, generator=_gen()).to(dtype)
    k = torch.randn(1, 2, 1, 8, generator=_gen(1)).to(dtype)
    cos, sin = rotary(q, torch.tensor([[37]]))
    want_q, want_k = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    got_q, got_k = q.clone().reshape(-1), k.clone().reshape(-1)
    lean_step.rope_(got_q, got_k, cos.reshape(-1).contiguous(), sin.reshape(-1).contiguous())
    assert torch.equal(got_q, want_q.reshape(-1)) and torch.equal(got_k, want_k.reshape(-1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_adds_the_residual_in_place_then_normalises(dtype):
    norm = modeling_llama.LlamaRMSNorm(24, eps=1e-5)
    norm.weight.data = torch.rand(24, generator=_gen()) + 0.5
    norm = norm.to(dtype)
    x = (torch.randn(1, 1, 24, generator=_gen(1)) * 3).to(dtype)
    add = torch.randn(1, 1, 24, generator=_gen(2)).to(dtype)
    residual = x + add
    y = lean_step.rmsnorm(x, norm.weight, norm.variance_epsilon, add)
    assert torch.equal(x, residual)  # the residual stream, rounded as transformers rounds it
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # the mean's summation order
    torch.testing.assert_close(y, norm(residual), rtol=tol, atol=tol)
    y_plain = lean_step.rmsnorm(residual.clone(), norm.weight, norm.variance_epsilon)
    assert torch.equal(y_plain, y)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("length", [1, 7, 40])
@pytest.mark.parametrize("strided", [False, True])
def test_attend_is_sdpa_for_one_query_with_gqa(dtype, length, strided):
    heads, kv_heads, hd = 6, 2, 16
    q = torch.randn(1, 1, heads * hd, generator=_gen()).to(dtype)
    keys = torch.randn(1, kv_heads, length, hd, generator=_gen(1)).to(dtype)
    values = torch.randn(1, kv_heads, length, hd, generator=_gen(2)).to(dtype)
    if strided:  # a cache's first update keeps the (1, 1, heads, hd) projection's view
        keys = keys.transpose(1, 2).contiguous().transpose(1, 2)
        values = values.transpose(1, 2).contiguous().transpose(1, 2)
    scale = hd**-0.5
    want = F.scaled_dot_product_attention(
        q.view(1, 1, heads, hd).transpose(1, 2).float(), keys.float(), values.float(),
        scale=scale, enable_gqa=True,
    )  # fmt: skip
    got = lean_step.attend(q, keys, values, scale)
    assert got.dtype == dtype and got.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(
        got.float(), want.transpose(1, 2).reshape(1, 1, -1), rtol=tol, atol=tol
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_is_the_mlp_activation(dtype):
    gate = (torch.randn(1, 1, 40, generator=_gen()) * 4).to(dtype)
    up = torch.randn(1, 1, 40, generator=_gen(1)).to(dtype)
    want = F.silu(gate) * up
    got = lean_step.silu_mul(gate, up)
    if dtype == torch.bfloat16:
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    else:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def _model(kind, dtype, family="llama"):
    model = make_tiny_model(family)
    if kind == "int4":
        compress(model, RTNConfig(bits=4, group_size=16))
    model = model.to(dtype).eval()
    if kind == "int4":
        prepare_decode(model)
    return model


def _steps(forward, model, prompt, tokens):
    """Logits of each of ``tokens`` fed one at a time after ``prompt`` (teacher forcing)."""
    cache = DynamicCache()
    with torch.inference_mode():
        model(input_ids=prompt, cache=cache, use_cache=True)
        out = [forward(input_ids=t.view(1, 1), cache=cache, use_cache=True).logits for t in tokens]
    return torch.cat(out, 1), cache


@pytest.mark.parametrize("family", list(lean_decode.FAMILIES))
@pytest.mark.parametrize("kind", ["dense", "int4"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_lean_steps_compute_what_transformers_steps_do(monkeypatch, family, kind, dtype):
    model = _model(kind, dtype, family)
    lean = LeanDecoder(model)
    assert lean.unsupported is None
    prompt = torch.randint(3, 250, (1, 5), generator=_gen())
    tokens = torch.randint(3, 250, (9,), generator=_gen(1))
    calls = count_calls(monkeypatch, LeanDecoder, "step")
    want, want_cache = _steps(model, model, prompt, tokens)
    got, got_cache = _steps(lean, model, prompt, tokens)
    assert calls["n"] == len(tokens)
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert got_cache.get_seq_length() == want_cache.get_seq_length() == 5 + len(tokens)
    for layer_got, layer_want in zip(got_cache.layers, want_cache.layers, strict=True):
        torch.testing.assert_close(layer_got.keys, layer_want.keys, rtol=tol, atol=tol)
        torch.testing.assert_close(layer_got.values, layer_want.values, rtol=tol, atol=tol)


def test_lean_steps_and_transformers_steps_share_one_cache():
    model = _model("int4", torch.float32)
    lean = LeanDecoder(model)
    prompt = torch.randint(3, 250, (1, 4), generator=_gen())
    tokens = torch.randint(3, 250, (6,), generator=_gen(1))
    want, _ = _steps(model, model, prompt, tokens)
    turns = iter([lean, model, model, lean, lean, model])
    got, _ = _steps(lambda **kw: next(turns)(**kw), model, prompt, tokens)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_greedy_decoding_picks_the_same_tokens():
    model = _model("dense", torch.float32)
    lean = LeanDecoder(model)
    picked = {}
    for name, forward in (("hf", model), ("lean", lean)):
        cache, token, out = DynamicCache(), torch.tensor([[5, 9, 11]]), []
        with torch.inference_mode():
            for _ in range(12):
                logits = forward(input_ids=token, cache=cache, use_cache=True).logits
                token = logits[:, -1:].argmax(-1)
                out.append(token.item())
        picked[name] = out
    assert picked["lean"] == picked["hf"]


def _refuse(*_args):
    pytest.fail("lean step taken")


@pytest.mark.parametrize(
    "call",
    [
        {"input_ids": torch.tensor([[3, 4]])},  # two tokens
        {"input_ids": torch.tensor([[3], [4]])},  # a batch
        {"input_ids": torch.tensor([[3]]), "attention_mask": torch.tensor([[0, 1, 1, 1]])},
        {"input_ids": torch.tensor([[3]]), "output_hidden_states": True},
        {"input_ids": torch.tensor([[3]]), "position_ids": torch.tensor([[7]])},
        {"input_ids": torch.tensor([[3]]), "use_cache": False},
    ],
)
def test_other_calls_run_the_models_own_forward(monkeypatch, call):
    model = _model("dense", torch.float32)
    lean = LeanDecoder(model)
    monkeypatch.setattr(LeanDecoder, "step", _refuse)
    cache = DynamicCache()
    batch = call["input_ids"].shape[0]
    with torch.inference_mode():
        model(input_ids=torch.full((batch, 3), 7), cache=cache, use_cache=True)
        lean(cache=cache, **call)


def test_a_step_with_gradients_on_runs_the_models_forward(monkeypatch):
    model = _model("dense", torch.float32)
    monkeypatch.setattr(LeanDecoder, "step", _refuse)
    cache = DynamicCache()
    model(input_ids=torch.tensor([[3, 4]]), cache=cache, use_cache=True)
    LeanDecoder(model)(input_ids=torch.tensor([[5]]), cache=cache, use_cache=True)


def test_an_all_ones_mask_keeps_the_lean_step():
    model = _model("dense", torch.float32)
    lean = LeanDecoder(model)
    cache = DynamicCache()
    with torch.inference_mode():
        model(input_ids=torch.tensor([[3, 4]]), cache=cache, use_cache=True)
        kwargs = {"input_ids": torch.tensor([[5]]), "cache": cache}
        assert lean.applies({**kwargs, "attention_mask": torch.ones(1, 3, dtype=torch.long)})


@pytest.mark.parametrize("model_type", ["gemma3_text", "gpt2", "opt"])
def test_other_families_are_left_to_transformers(model_type):
    model = make_tiny_model(model_type)
    assert "model type" in LeanDecoder(model).unsupported


def test_qwen3s_block_is_refused():
    from conftest import make_qwen3

    assert "model type" in LeanDecoder(make_qwen3()).unsupported


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_a_sliding_window_takes_the_lean_step_only_while_it_sees_every_token(family, monkeypatch):
    config = make_tiny_model(family).config
    config.sliding_window = 6
    if family == "qwen2":  # sliding layers from the start: Qwen2 derives them at init
        config = type(config)(**{**config.to_dict(), "use_sliding_window": True})
        config.layer_types = ["sliding_attention"] * config.num_hidden_layers
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    lean = LeanDecoder(model)
    assert lean.window == 6
    steps = count_calls(monkeypatch, LeanDecoder, "step")
    prompt = torch.randint(3, 250, (1, 3), generator=_gen())
    tokens = torch.randint(3, 250, (6,), generator=_gen(1))
    got, _ = _steps(lean, model, prompt, tokens)
    want, _ = _steps(model, model, prompt, tokens)
    assert steps["n"] == 3  # caches of 3, 4, 5 tokens: the window of 6 sees them all
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_another_activation_is_refused():
    model = make_tiny_model("llama")
    model.config.hidden_act = "gelu"
    assert "activation" in lean_decode.supports(model)


def _unfused(decoder):
    decoder._int4_block = lambda *_args: None
    return decoder


def _blockwise(decoder):
    decoder._stack = lambda *_args: None
    return decoder


@pytest.mark.parametrize("family", list(lean_decode.FAMILIES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_int4_stack_in_one_call_computes_the_blocks_and_the_separate_calls_bit_for_bit(
    monkeypatch, family, dtype
):
    model = _model("int4", dtype, family)
    stack = count_calls(monkeypatch, int4_lean, "run_stack")
    calls = {name: count_calls(monkeypatch, int4_lean.Int4Block, name) for name in ("pre", "post")}
    prompt = torch.randint(3, 250, (1, 5), generator=_gen())
    tokens = torch.randint(3, 250, (7,), generator=_gen(1))
    runs = {"stack": _steps(LeanDecoder(model), model, prompt, tokens)}
    assert stack["n"] == len(tokens) and calls == {"pre": {"n": 0}, "post": {"n": 0}}
    runs["blocks"] = _steps(_blockwise(LeanDecoder(model)), model, prompt, tokens)
    assert calls == {"pre": {"n": 2 * len(tokens)}, "post": {"n": 2 * len(tokens)}}  # 2 blocks
    runs["separate"] = _steps(_unfused(LeanDecoder(model)), model, prompt, tokens)
    assert stack["n"] == len(tokens)
    separate, separate_cache = runs["separate"]
    for logits, cache in (runs["stack"], runs["blocks"]):
        assert torch.equal(logits, separate)
        for a, b in zip(cache.layers, separate_cache.layers, strict=True):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_the_stack_grows_its_buffers_and_follows_whatever_else_changed_the_cache(monkeypatch):
    """Buffers of ~2 positions to spare: the stack fills them to the last position, moves into
    larger ones, and takes the cache back after transformers' forward appended to it, after a
    crop and after a cache that the caller replaced the tensors of; the same logits as the
    blocks' path throughout."""
    from lmcompress.compressor import lean_cache

    monkeypatch.setattr(lean_cache, "STEP", 2)
    model = _model("int4", torch.float32)
    adopt = count_calls(monkeypatch, lean_cache.GrowingKV, "adopt")
    prompt = torch.randint(3, 250, (1, 4), generator=_gen())
    tokens = torch.randint(3, 250, (16,), generator=_gen(1))
    got = {}
    for name, lean in (("stack", LeanDecoder(model)), ("blocks", _blockwise(LeanDecoder(model)))):
        cache, out = DynamicCache(), []
        with torch.inference_mode():
            model(input_ids=prompt, cache=cache, use_cache=True)
            for i, token in enumerate(tokens):
                forward = model if i in (6, 7) else lean  # transformers appends by torch.cat
                if i == 11:
                    cache.crop(-2)
                if i == 13:
                    for layer in cache.layers:  # new tensors, same contents
                        layer.keys, layer.values = layer.keys.clone(), layer.values.clone()
                out.append(forward(input_ids=token.view(1, 1), cache=cache, use_cache=True).logits)
        got[name] = (torch.cat(out, 1), cache)
    # 4 positions: room to 8 (4 + 1 + 1 + 2, rounded up to STEP), filled at step 4; then
    # after transformers' two steps, the crop and the replaced tensors
    assert adopt["n"] == 5
    assert torch.equal(got["stack"][0], got["blocks"][0])
    for a, b in zip(got["stack"][1].layers, got["blocks"][1].layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_the_stack_keeps_nothing_of_a_finished_cache():
    import gc

    model = _model("int4", torch.float32)
    lean = LeanDecoder(model)
    _steps(lean, model, torch.tensor([[5, 9, 11]]), torch.tensor([4, 8]))
    gc.collect()
    assert len(lean.grown) == 0  # the buffers went with the cache


def _stepped_int4():
    """An int4 model, its LeanDecoder after three steps (its blocks planned), the steps' inputs."""
    model = _model("int4", torch.float32)
    lean = LeanDecoder(model)
    prompt, tokens = torch.tensor([[5, 9, 11]]), torch.tensor([4, 8, 15])
    _steps(lean, model, prompt, tokens)
    return model, lean, prompt, tokens


def test_an_int4_plan_follows_the_layers_it_points_to():
    model, lean, prompt, tokens = _stepped_int4()
    first = lean.blocks[0][1]
    assert first is not None and first.valid()
    o_proj = model.model.layers[0].self_attn.o_proj
    o_proj.qweight = o_proj.qweight ^ 0x11  # other codes in a new tensor
    assert not first.valid()
    got, _ = _steps(lean, model, prompt, tokens)
    assert lean.blocks[0][1] is not first  # planned again, on the new codes
    want, _ = _steps(_unfused(LeanDecoder(model)), model, prompt, tokens)
    assert torch.equal(got, want)


def test_a_block_planned_again_mid_generation_is_used_on_the_same_cache():
    """The stack's table follows its blocks: new codes after the third token, one cache."""
    got = {}
    for name in ("stack", "separate"):
        model = _model("int4", torch.float32)
        lean = LeanDecoder(model) if name == "stack" else _unfused(LeanDecoder(model))
        cache, out = DynamicCache(), []
        with torch.inference_mode():
            model(input_ids=torch.tensor([[5, 9, 11]]), cache=cache, use_cache=True)
            for i, token in enumerate([4, 8, 15, 16, 23]):
                if i == 3:
                    o_proj = model.model.layers[0].self_attn.o_proj
                    o_proj.qweight = o_proj.qweight ^ 0x11  # other codes in a new tensor
                ids = torch.tensor([[token]])
                out.append(lean(input_ids=ids, cache=cache, use_cache=True).logits)
        got[name] = torch.cat(out, 1)
    assert torch.equal(got["stack"], got["separate"])


def test_a_replaced_linear_is_seen_though_the_old_one_holds_its_tensors():
    model, lean, prompt, tokens = _stepped_int4()
    first = lean.blocks[0][1]
    attn = model.model.layers[0].self_attn
    dense = torch.nn.Linear(attn.o_proj.in_features, attn.o_proj.out_features, bias=False)
    dense.weight.data = torch.randn(dense.weight.shape, generator=_gen(3))
    attn.o_proj = dense  # the old int4 module still holds every tensor the plan points to
    assert not first.valid()
    got, _ = _steps(lean, model, prompt, tokens)
    assert lean.blocks[0][1] is None  # no int4 plan for a block with a dense o_proj
    want, _ = _steps(model, model, prompt, tokens)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_blocks_without_shared_int4_siblings_have_no_plan():
    dense = _model("dense", torch.float32)
    assert all(int4_lean.plan(layer) is None for layer in dense.model.layers)
    model = _model("int4", torch.float32)
    layer = model.model.layers[0]
    k_proj = layer.self_attn.k_proj
    k_proj.qweight = k_proj.qweight.clone()  # its own tensor: no longer the group's view
    assert int4_lean.plan(layer) is None
    assert int4_lean.plan(model.model.layers[1]) is not None


@pytest.mark.parametrize("kind", ["dense", "int4"])
def test_generate_takes_the_lean_step_when_it_is_the_models_forward(monkeypatch, kind):
    model = _model(kind, torch.float32)
    ids = torch.tensor([[5, 9, 11, 3]])
    want = model.generate(ids, max_new_tokens=8, do_sample=False)
    steps = count_calls(monkeypatch, LeanDecoder, "step")
    stack = count_calls(monkeypatch, int4_lean, "run_stack")
    model.forward = LeanDecoder(model)
    got = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(got, want)
    assert steps["n"] == 7  # every step after the prompt's (the last token is not fed back)
    assert stack["n"] == (7 if kind == "int4" else 0)  # generate's cache takes the int4 stack


def test_return_dict_false_runs_the_models_forward(monkeypatch):
    model = _model("dense", torch.float32)
    monkeypatch.setattr(LeanDecoder, "step", _refuse)
    cache = DynamicCache()
    with torch.inference_mode():
        model(input_ids=torch.tensor([[3, 4]]), cache=cache, use_cache=True)
        out = LeanDecoder(model)(input_ids=torch.tensor([[5]]), cache=cache, return_dict=False)
    assert isinstance(out, tuple)


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_24_int4_blocks_in_two_calls_compute_the_separate_calls(monkeypatch, dtype):
    from lmcompress.compressor.formats.int4 import PackedNMInt4Linear
    from lmcompress.compressor.formats.int4_shared import share_inputs
    from lmcompress.compressor.sparsity import nm_mask
    from lmcompress.kernels import int4_tiles24

    monkeypatch.setattr(int4_tiles24, "hold", lambda: True)
    model = make_tiny_model("llama")
    for block in model.model.layers:
        for parent in (block.self_attn, block.mlp):
            for name, child in list(parent.named_children()):
                if not isinstance(child, torch.nn.Linear):
                    continue
                with torch.no_grad():
                    child.weight *= nm_mask(child.weight.abs(), 2, 4)
                setattr(parent, name, PackedNMInt4Linear.from_linear(child, 2, 4, group_size=16))
    model = model.to(dtype).eval()
    assert share_inputs(model) == 2 * model.config.num_hidden_layers
    lean = LeanDecoder(model)
    prompt, tokens = torch.tensor([[5, 9, 11]]), torch.randint(3, 250, (6,), generator=_gen())
    fused, _ = _steps(lean, model, prompt, tokens)
    assert all(block is not None for _, block in lean.blocks.values())
    separate, _ = _steps(_unfused(LeanDecoder(model)), model, prompt, tokens)
    assert torch.equal(fused, separate)
    want, _ = _steps(model, model, prompt, tokens)
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(fused, want, rtol=tol, atol=tol)
