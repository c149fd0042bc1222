"""One decode call for the int4 siblings that read one input (``formats/int4_shared.py``):
which layers are grouped, their buffers views of the group's (stored tensors unchanged),
decoding bit for bit equal to the separate calls, and each sibling served once per input
object (a reused, rewritten input buffer, a member called alone or twice, a member whose
buffers were replaced: each computes its own rows)."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import make_odd_llama, make_tiny_model, make_tiny_tokenizer, requires_kernels

from lmcompress import compress, load_compressed, save_compressed
from lmcompress.compressor.formats import int4_shared as shared_module
from lmcompress.compressor.formats.int4 import Int4Linear, PackedNMInt4Linear
from lmcompress.compressor.formats.int4_shared import share_inputs
from lmcompress.compressor.sparsity import nm_mask
from lmcompress.kernels import int4_tiles24
from lmcompress.methods.gptq import RTNConfig

pytestmark = requires_kernels


def _int4(model, group_size=16):
    compress(model, RTNConfig(bits=4, group_size=group_size))
    return model.eval()


def _members(model):
    return [
        m for m in model.modules() if isinstance(m, Int4Linear) and "shared_input" in m.__dict__
    ]


def test_qkv_and_gate_up_of_every_block_share_one_call():
    model = _int4(make_tiny_model("llama"))
    stored = {n: m.state_tensors() for n, m in model.named_modules() if isinstance(m, Int4Linear)}
    assert share_inputs(model) == 2 * model.config.num_hidden_layers
    attn = model.model.layers[0].self_attn
    group, index = attn.k_proj.shared_input
    assert group is attn.q_proj.shared_input[0] and index == 1
    assert attn.k_proj.qweight.untyped_storage().data_ptr() == (
        group.buffers["qweight"].untyped_storage().data_ptr()
    )
    assert "shared_input" not in model.model.layers[0].mlp.down_proj.__dict__
    assert len(_members(model)) == 5 * model.config.num_hidden_layers
    for name, module in model.named_modules():
        if isinstance(module, Int4Linear):
            for key, tensor in module.state_tensors().items():
                assert torch.equal(tensor, stored[name][key]), (name, key)
    assert share_inputs(model) == 0  # already shared


def test_siblings_off_the_tile_grid_are_not_grouped():
    """An intermediate width of 36 (not a multiple of 16 rows): gate and up stay apart."""
    model = _int4(make_odd_llama(), group_size=-1)
    assert share_inputs(model) == 1  # q, k, v only
    assert "shared_input" not in model.model.layers[0].mlp.gate_proj.__dict__


@torch.inference_mode()
def test_decoding_is_the_separate_calls_bit_for_bit(tmp_path):
    model = make_tiny_model("llama")
    report = compress(model, RTNConfig(bits=4, group_size=16))
    out = save_compressed(model, tmp_path / "out", report, tokenizer=make_tiny_tokenizer())
    shared = load_compressed(out, runtime="packed")[0]
    assert len(_members(shared)) == 5 * shared.config.num_hidden_layers
    alone = load_compressed(out, runtime="packed")[0]
    for module in _members(alone):
        del module.__dict__["shared_input"]  # the views stay: the same tensors, one call each
    ids = torch.randint(0, 200, (1, 7), generator=torch.Generator().manual_seed(0))
    kw = {"max_new_tokens": 6, "do_sample": False, "output_logits": True}
    a = shared.generate(ids, return_dict_in_generate=True, **kw)
    b = alone.generate(ids, return_dict_in_generate=True, **kw)
    assert torch.equal(a.sequences, b.sequences)
    assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits, strict=True))


@torch.inference_mode()
def test_each_sibling_is_served_once_per_input_object():
    model = _int4(make_tiny_model("llama"))
    reference = copy.deepcopy(model).model.layers[0].self_attn  # never shared
    share_inputs(model)
    attn = model.model.layers[0].self_attn
    names = ("q_proj", "k_proj", "v_proj")

    def want(x):
        return {name: getattr(reference, name)(x.clone()) for name in names}

    width = model.config.hidden_size
    x = torch.randn(1, 1, width)
    first = want(x)
    for name in names:
        assert torch.equal(getattr(attn, name)(x), first[name]), name
    assert attn.q_proj.shared_input[0].pending is None  # all three served: nothing kept
    x.mul_(2)  # a reused input buffer, rewritten for the next step
    second = want(x)
    assert torch.equal(attn.q_proj(x), second["q_proj"])
    x.mul_(-1)  # rewritten while that call is kept for k and v: q again computes anew
    second = want(x)
    assert torch.equal(attn.q_proj(x), second["q_proj"])
    assert torch.equal(attn.k_proj(x), second["k_proj"])
    doubled = attn.k_proj.scales * 2  # replaced: k computes from its own grid, not the group's
    attn.k_proj.scales = doubled
    reference.k_proj.scales = doubled
    assert torch.equal(attn.k_proj(x), want(x)["k_proj"])
    other = torch.randn(1, 1, width)  # another object while x's call is pending for v
    assert torch.equal(attn.v_proj(other), want(other)["v_proj"])
    assert torch.equal(attn.v_proj(x), second["v_proj"])


@torch.inference_mode()
def test_the_decode_tensors_move_into_one_mapping_with_the_same_values(monkeypatch):
    """``place_in_huge_pages`` (forced here: the tiny model holds less than a huge page): every
    tile and tiled grid in one storage, the shared groups' views rebound to it (the shared call
    still serves the siblings), outputs unchanged; a copy of the model takes its own memory."""
    monkeypatch.setattr(shared_module, "_HUGE_PAGE", 0)
    model = _int4(make_tiny_model("llama"))
    share_inputs(model)
    x = torch.randn(1, 1, model.config.hidden_size)
    ids = torch.randint(0, 200, (1, 5), generator=torch.Generator().manual_seed(1))
    before = model(ids).logits
    layers = [m for m in model.modules() if isinstance(m, Int4Linear)]
    moved = shared_module.place_in_huge_pages(model)
    if moved == 0:
        pytest.skip("no MADV_HUGEPAGE on this platform")
    storages = {
        m._buffers[key].untyped_storage().data_ptr()
        for m in layers
        for key in ("qweight", "scales16", "zeros16")
    }
    assert len(storages) == 1 and moved >= sum(m.qweight.nbytes for m in layers)
    assert torch.equal(model(ids).logits, before)
    attn = model.model.layers[0].self_attn
    attn.q_proj(x)
    assert attn.q_proj.shared_input[0].pending is not None  # one call, kept for k and v
    copied = copy.deepcopy(model)
    assert copied.model.layers[0].mlp.down_proj.qweight.untyped_storage().data_ptr() not in storages
    assert torch.equal(copied(ids).logits, before)


def _packed_24(model):
    """Every decoder linear pruned to 2:4 by magnitude and rounded to 4 bits, held tiled
    (``kernels/int4_tiles24.py``)."""
    for block in model.model.layers:
        for parent in (block.self_attn, block.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear):
                    with torch.no_grad():
                        child.weight *= nm_mask(child.weight.abs(), 2, 4)
                    new = PackedNMInt4Linear.from_linear(child, n=2, m=4, bits=4, group_size=16)
                    setattr(parent, name, new)
    return model.eval()


@torch.inference_mode()
def test_tiled_24_siblings_share_one_call_and_one_mapping(monkeypatch):
    """Tiled 2:4 int4 layers (their patterns too) are grouped and placed as int4 ones: the
    shared call's outputs are the separate calls' bit for bit, before and after placing."""
    monkeypatch.setattr(int4_tiles24, "hold", lambda: True)
    monkeypatch.setattr(shared_module, "_HUGE_PAGE", 0)
    model = _packed_24(make_tiny_model("llama"))
    alone = copy.deepcopy(model)
    assert all(m.tiled for m in model.modules() if isinstance(m, PackedNMInt4Linear))
    assert share_inputs(model) == 2 * model.config.num_hidden_layers
    attn = model.model.layers[0].self_attn
    group = attn.q_proj.shared_input[0]
    assert attn.v_proj.indices.untyped_storage().data_ptr() == (
        group.buffers["indices"].untyped_storage().data_ptr()
    )
    ids = torch.randint(0, 200, (1, 1), generator=torch.Generator().manual_seed(2))
    want = alone(ids).logits
    x = torch.randn(1, 1, model.config.hidden_size)
    attn.q_proj(x)
    assert group.pending is not None  # one call, kept for k and v
    assert torch.equal(attn.k_proj(x), alone.model.layers[0].self_attn.k_proj(x))
    assert torch.equal(model(ids).logits, want)
    if shared_module.place_in_huge_pages(model) == 0:
        pytest.skip("no MADV_HUGEPAGE on this platform")
    storages = {
        m._buffers[key].untyped_storage().data_ptr()
        for m in model.modules()
        if isinstance(m, PackedNMInt4Linear)
        for key in ("qweight", "indices", "scales16", "zeros16")
    }
    assert len(storages) == 1
    assert torch.equal(model(ids).logits, want)
