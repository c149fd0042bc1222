"""Where each model family keeps its decoder blocks, embeddings and head.

This is the only model-specific table in lmcompress: everything else finds modules through it.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from lmcompress.errors import ModelLoadError


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


_QKV_GATE_UP = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
_LLAMA = Family(
    blocks="model.layers",
    embeddings=("model.embed_tokens",),
    head="lm_head",
    shared_inputs=_QKV_GATE_UP,
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
    ),
    "gpt2": Family(
        blocks="transformer.h", embeddings=("transformer.wte", "transformer.wpe"), head="lm_head"
    ),
    "opt": Family(
        blocks="model.decoder.layers",
        embeddings=("model.decoder.embed_tokens", "model.decoder.embed_positions"),
        head="lm_head",
        shared_inputs=(("q_proj", "k_proj", "v_proj"),),
    ),
    # transformers >= 5 calls GPT-NeoX's head lm_head (embed_out before).
    "gpt_neox": Family(blocks="gpt_neox.layers", embeddings=("gpt_neox.embed_in",), head="lm_head"),
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
