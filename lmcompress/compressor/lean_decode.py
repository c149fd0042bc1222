"""A lean decode step for Llama-family models (Llama, Mistral, Qwen2) on CPU: one token, the
layers' own linears, the rest in a few compiled calls (:mod:`lmcompress.kernels.lean_step`).

At batch-1 decoding on a small CPU, transformers' step is mostly not its linears: on a 2-core
AMD EPYC, SmolLM2-135M with int4 weights spent ~27 of a ~37 ms step outside its kernels (the
model's Python, masks, ~50 small ops a layer, ``scaled_dot_product_attention`` at ~100 µs a
call for one query). :class:`LeanDecoder` runs the same computation for a one-token step as

    x = embed(token); cos, sin = rotary(position)
    for each block: h = norm(x); q, k, v = q_proj(h), k_proj(h), v_proj(h); rope(q, k)
                    K, V = cache.update(k, v); x = x + o_proj(attend(q, K, V))
                    h = norm(x); x = x + down_proj(silu(gate_proj(h)) * up_proj(h))
    logits = lm_head(norm(x))

calling each linear module as the model holds it (dense ``nn.Linear`` or any compressed layer,
so that every format, dense included, runs on the same step), and everything else through four
kernels that round to the model dtype where transformers does. A block of tiled int4 layers
goes in two compiled calls instead (:mod:`~lmcompress.compressor.formats.int4_lean`: the same
kernels, bit for bit), and where every block is such a block, the whole stack goes in one
call that writes each token's k and v in place (:mod:`~lmcompress.compressor.lean_cache`: the
cache's layers hold views of buffers with room to grow). The KV cache is the caller's
``DynamicCache``, updated as transformers updates it (or with views of the same values), so a
step may follow or precede transformers' own forward.
Outputs match transformers' eager step to the attention's summation order (tests: logits within
float tolerance, the same greedy tokens). Llama, Mistral and Qwen2 share that block (Qwen2's
q, k and v biases are in its linears; a sliding window is full attention while the cache is
shorter than the window: beyond it the model's forward runs).

Anything else — more than one token, a batch, an attention mask with padding, gradients, another
family or device, a static cache, outputs other than logits — runs the model's own forward.
``model.forward = LeanDecoder(model)`` puts it under ``model.generate``: greedy or sampled
decoding at batch 1 then takes the lean step after the prompt.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from lmcompress.compressor import lean_cache
from lmcompress.compressor.formats import int4_lean
from lmcompress.kernels import lean_step

# model types whose decoder block is exactly the step above: their block's classes
FAMILIES = {
    name: tuple(f"{prefix}{part}" for part in ("DecoderLayer", "Attention", "MLP", "RMSNorm"))
    for name, prefix in (("llama", "Llama"), ("mistral", "Mistral"), ("qwen2", "Qwen2"))
}
# forward keywords the lean step honours by what it does (anything else: the model's forward)
_KNOWN = {"input_ids", "cache", "past_key_values", "use_cache", "cache_position", "position_ids"}
_KNOWN |= {"attention_mask", "return_dict"}


def supports(model: nn.Module) -> str | None:
    """``None`` where :class:`LeanDecoder` can run ``model``'s one-token steps, else why not."""
    config = getattr(model, "config", None)
    block = FAMILIES.get(getattr(config, "model_type", None))
    if block is None:
        return f"model type {getattr(config, 'model_type', None)!r} (lean step: {list(FAMILIES)})"
    if getattr(config, "hidden_act", None) != "silu":
        return f"activation {config.hidden_act!r} (lean step: silu)"
    body = getattr(model, "model", None)
    if body is None or not hasattr(body, "rotary_emb") or not hasattr(model, "lm_head"):
        return "no model.model.rotary_emb / lm_head"
    if lean_step.library() is None:
        return "the CPU kernels are not built"
    for layer in body.layers:
        names = (
            type(layer).__name__,
            type(layer.self_attn).__name__,
            type(layer.mlp).__name__,
            type(layer.input_layernorm).__name__,
        )
        if names != block:
            return f"block {names} (lean step: {block})"
        if layer.self_attn.head_dim > lean_step.MAX_HEAD_DIM:
            return f"head_dim {layer.self_attn.head_dim} > {lean_step.MAX_HEAD_DIM}"
    return None


class LeanDecoder:
    """``model.forward``'s stand-in for decoding on CPU: one-token steps of a Llama, Mistral or
    Qwen2 model (dense or compressed layers) through the lean step where :meth:`applies`,
    every other call the model's own forward. Returns transformers' output (``.logits``).

    ``model.forward = LeanDecoder(model)`` makes ``model.generate`` take it after the prompt
    (batch 1); ``compress-model bench --lean`` times it beside every row.
    ``unsupported``: why a model has no lean step (``None`` where it has one)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.forward = model.forward  # the fallback: ``model.forward = LeanDecoder(model)`` works
        self.unsupported = supports(model)
        self.window = None if self.unsupported else _window(model)
        self.blocks: dict[int, tuple] = {}  # block index -> (layer, its int4 plan or None)
        self.grown = weakref.WeakKeyDictionary()  # cache -> its GrowingKV (one-call stacks)

    def __call__(self, **kwargs: Any) -> Any:
        if not self.applies(kwargs):
            return self.forward(**kwargs)
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        logits = self.step(kwargs["input_ids"], cache)
        return CausalLMOutputWithPast(logits=logits, cache=cache)

    def applies(self, kwargs: dict[str, Any]) -> bool:
        """Whether a call with ``kwargs`` runs the lean step."""
        if self.unsupported or not set(kwargs) <= _KNOWN:
            return False
        ids, cache = kwargs.get("input_ids"), kwargs.get("cache", kwargs.get("past_key_values"))
        mask = kwargs.get("attention_mask")
        return (
            ids is not None
            and tuple(ids.shape) == (1, 1)
            and ids.device.type == "cpu"
            and type(cache).__name__ == "DynamicCache"
            and kwargs.get("use_cache", True) is not False
            and kwargs.get("return_dict", True) is not False
            and kwargs.get("position_ids") is None
            and (self.window is None or cache.get_seq_length() < self.window)
            and (mask is None or bool(mask.all()))
            and not torch.is_grad_enabled()
            and self.model.dtype in lean_step.KINDS
        )

    @torch.no_grad()
    def step(self, input_ids: torch.Tensor, cache: Any) -> torch.Tensor:
        """Logits (1, 1, vocab) of one token ``input_ids`` (1, 1) after ``cache``'s tokens;
        ``cache`` gains the token's keys and values."""
        body = self.model.model
        x = body.embed_tokens(input_ids)  # (1, 1, hidden)
        position = torch.tensor([[cache.get_seq_length()]], device=x.device)
        cos, sin = body.rotary_emb(x, position)
        cos, sin = cos.reshape(-1).contiguous(), sin.reshape(-1).contiguous()
        layers = list(body.layers)[: self.model.config.num_hidden_layers]  # not a ModuleList
        blocks = [self._int4_block(index, layer) for index, layer in enumerate(layers)]
        residual = self._stack(blocks, x, cos, sin, cache)
        if residual is None:  # block by block
            residual = self._blocks(layers, blocks, x, cos, sin, cache)
        h = lean_step.rmsnorm(x, body.norm.weight, body.norm.variance_epsilon, residual)
        return self.model.lm_head(h)

    def _blocks(self, layers, blocks, x, cos, sin, cache) -> torch.Tensor:
        """The step's blocks one by one on ``x`` (updated in place): the last block's MLP
        output, the residual update the final norm adds."""
        residual = None  # the last update of the residual stream, added by the next norm
        for layer, block in zip(layers, blocks, strict=True):
            if block is not None:
                residual = self._fused_block(layer, block, x, residual, cos, sin, cache)
                continue
            attn, mlp, norm = layer.self_attn, layer.mlp, layer.input_layernorm
            h = lean_step.rmsnorm(x, norm.weight, norm.variance_epsilon, residual)
            q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
            lean_step.rope_(q, k, cos, sin)
            keys, values = _update(cache, attn, k, v)
            x_att = attn.o_proj(lean_step.attend(q, keys, values, attn.scaling))
            norm = layer.post_attention_layernorm
            h = lean_step.rmsnorm(x, norm.weight, norm.variance_epsilon, x_att)
            residual = mlp.down_proj(lean_step.silu_mul(mlp.gate_proj(h), mlp.up_proj(h)))
        return residual

    def _stack(self, blocks, x, cos, sin, cache) -> torch.Tensor | None:
        """Every block in one call (:func:`int4_lean.run_stack`) where each is a two-call
        int4 block and ``cache`` can hold its keys and values in :class:`GrowingKV` buffers;
        else ``None``. The same kernels in the same order as :meth:`_blocks`, bit for bit."""
        if any(block is None for block in blocks) or len(cache.layers) != len(blocks):
            return None
        kv = self.grown.get(cache)
        length = None if kv is None else kv.length(cache)
        if length is None:
            length = lean_cache.usable(cache, self.model.dtype)
            if length is None:
                return None
            kv = self.grown[cache] = lean_cache.GrowingKV()
            kv.adopt(cache, length)
        if kv.table is None or kv.table[0] != tuple(blocks):  # blocks by identity
            kv.table = (tuple(blocks), int4_lean.stack_table(blocks, kv))
        down = int4_lean.run_stack(kv.table[1], x, cos, sin, length)
        kv.advance(cache, length + 1)
        return down

    def _int4_block(self, index: int, layer: nn.Module) -> int4_lean.Int4Block | None:
        """Block ``index``'s two-call int4 plan (:mod:`int4_lean`), made once for each layer
        object and again where the layers no longer hold what it points to; ``None`` where the
        block has none."""
        held, block = self.blocks.get(index, (None, None))
        if held is not layer or (block is not None and not block.valid()):
            block = int4_lean.plan(layer)
            self.blocks[index] = (layer, block)
        return block

    @staticmethod
    def _fused_block(layer, block, x, residual, cos, sin, cache) -> torch.Tensor:
        attn, post = layer.self_attn, layer.post_attention_layernorm
        qkv = block.pre(x, residual, layer.input_layernorm.variance_epsilon, cos, sin)
        q_width, kv_width = block.heads * block.head_dim, block.kv_heads * block.head_dim
        k = qkv.narrow(-1, q_width, kv_width)
        v = qkv.narrow(-1, q_width + kv_width, kv_width)
        keys, values = _update(cache, attn, k, v)
        return block.post(x, qkv, keys, values, attn.scaling, post.variance_epsilon)


def _window(model: nn.Module) -> int | None:
    """The narrowest sliding attention window of ``model``'s blocks (Mistral's config, Qwen2's
    sliding layers), ``None`` for none: while the cache holds fewer tokens than it, a sliding
    window sees every cached token and the lean step's full attention is the same."""
    config_window = getattr(model.config, "sliding_window", None)
    windows = [
        getattr(layer.self_attn, "sliding_window", config_window) for layer in model.model.layers
    ]
    return min((w for w in windows if w), default=None)


def _update(cache: Any, attn: nn.Module, k: torch.Tensor, v: torch.Tensor) -> tuple:
    """``cache.update`` with one token's k and v (1, 1, KVH * hd): all keys and values."""
    hd = attn.head_dim
    return cache.update(
        k.view(1, 1, -1, hd).transpose(1, 2), v.view(1, 1, -1, hd).transpose(1, 2),
        attn.layer_idx,
    )  # fmt: skip
