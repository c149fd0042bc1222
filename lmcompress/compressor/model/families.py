"""Where each model family keeps its decoder blocks, embeddings and head.

This is the only model-specific table in lmcompress: everything else finds modules through it.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from lmcompress.errors import ModelLoadError


@dataclass(frozen=True)
class Structures:
    """What structured extraction (``compressor.model.structure``) removes in a family's decoder
    block, by dotted paths inside the block.

    ``mlp``: the MLP's linears and the axis of their weight (``out``: rows, ``in``: columns, of
    the (out, in) view) that indexes its hidden channels; ``mlp_width``: the config field of
    that width. ``attention_out`` / ``mlp_out``: the linears whose outputs are the block's two
    residual updates. ``kv_groups``: ``(q, k, v, o)`` of an attention whose heads split into
    KV groups that the standard code runs at any count (``num_attention_heads`` and
    ``num_key_value_heads`` with an explicit ``head_dim``); ``None`` where the code derives the
    head size from the hidden size (GPT-2, OPT, GPT-NeoX), so fewer heads cannot be written as
    a standard config."""

    mlp: tuple[tuple[str, str], ...]
    mlp_width: str
    attention_out: str
    mlp_out: str
    kv_groups: tuple[str, str, str, str] | None = None


_GATED = Structures(
    mlp=(("mlp.gate_proj", "out"), ("mlp.up_proj", "out"), ("mlp.down_proj", "in")),
    mlp_width="intermediate_size",
    attention_out="self_attn.o_proj",
    mlp_out="mlp.down_proj",
    kv_groups=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"),
)


@dataclass(frozen=True)
class Family:
    """Dotted attribute paths (from the ``*ForCausalLM`` model) of a family's parts."""

    blocks: str  # nn.ModuleList of decoder blocks
    embeddings: tuple[str, ...]  # input embeddings (token, and position where learned)
    head: str  # output projection to the vocabulary
    needs_bos: bool = False  # every window must start with BOS (Gemma)
    # linears of one parent module that the model's code calls on the same input tensor
    # (formats.int4_shared makes one decode kernel call of them)
    shared_inputs: tuple[tuple[str, ...], ...] = ()
    structures: Structures | None = None  # what structured extraction removes


_QKV_GATE_UP = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
_LLAMA = Family(
    blocks="model.layers",
    embeddings=("model.embed_tokens",),
    head="lm_head",
    shared_inputs=_QKV_GATE_UP,
    structures=_GATED,
)

FAMILIES: dict[str, Family] = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": _LLAMA,
    "gemma3_text": Family(
        blocks="model.layers",
        embeddings=("model.embed_tokens",),
        head="lm_head",
        needs_bos=True,
        shared_inputs=_QKV_GATE_UP,
        structures=_GATED,
    ),
    "gpt2": Family(
        blocks="transformer.h",
        embeddings=("transformer.wte", "transformer.wpe"),
        head="lm_head",
        structures=Structures(
            mlp=(("mlp.c_fc", "out"), ("mlp.c_proj", "in")),
            mlp_width="n_inner",
            attention_out="attn.c_proj",
            mlp_out="mlp.c_proj",
        ),
    ),
    "opt": Family(
        blocks="model.decoder.layers",
        embeddings=("model.decoder.embed_tokens", "model.decoder.embed_positions"),
        head="lm_head",
        shared_inputs=(("q_proj", "k_proj", "v_proj"),),
        structures=Structures(
            mlp=(("fc1", "out"), ("fc2", "in")),
            mlp_width="ffn_dim",
            attention_out="self_attn.out_proj",
            mlp_out="fc2",
        ),
    ),
    # transformers >= 5 calls GPT-NeoX's head lm_head (embed_out before).
    "gpt_neox": Family(
        blocks="gpt_neox.layers",
        embeddings=("gpt_neox.embed_in",),
        head="lm_head",
        structures=Structures(
            mlp=(("mlp.dense_h_to_4h", "out"), ("mlp.dense_4h_to_h", "in")),
            mlp_width="intermediate_size",
            attention_out="attention.dense",
            mlp_out="mlp.dense_4h_to_h",
        ),
    ),
}


def supported_model_types() -> str:
    return ", ".join(sorted(FAMILIES))


def family_of(model_or_type: nn.Module | str) -> Family:
    """The :class:`Family` of a model (or of a ``config.model_type`` string)."""
    if isinstance(model_or_type, str):
        model_type = model_or_type
    else:
        model_type = getattr(getattr(model_or_type, "config", None), "model_type", None)
    if model_type not in FAMILIES:
        raise ModelLoadError(
            f"unsupported architecture {model_type!r}; supported model types: "
            f"{supported_model_types()}"
        )
    return FAMILIES[model_type]


def decoder_blocks(model: nn.Module) -> nn.ModuleList:
    """The model's decoder blocks, in order."""
    return model.get_submodule(family_of(model).blocks)
