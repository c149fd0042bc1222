"""Export a low-bit model as one GGUF file (llama.cpp's format): ``--export gguf``.

What maps exactly: a weight-only layer on a symmetric grid of ``group_size`` 32 (``int4`` or
``nm_packed_int4``: GPTQ, RTN) is GGUF's ``Q4_0`` (4 bits) or ``Q8_0`` (8 bits), whose blocks of
32 consecutive input columns hold one float16 scale ``d`` and the codes: ``Q4_0`` weights are
``d · (q - 8)`` with ``q`` in ``[0, 15]`` (block byte ``j``: code ``j`` in the low nibble, code
``j + 16`` in the high one), ``Q8_0`` weights ``d · c`` with ``c`` int8, i.e. our ``(q - z) · s``
with ``z = 2^(bits-1)`` and ``c = q - 128``. The codes map one to one; the scale becomes float16.
A float32 scale that is not a float16 number is rounded (the GGUF's weights then differ from
the runtime's by at most half a float16 step of the scale, ``2^-11`` relative); the export logs
the largest change and records it, ``0.0`` when the method kept its scales float16-exact, which
is what "exactly" requires. A pruned ``nm_packed_int4`` layer is written dense (its pruned
positions hold ``z``: weight exactly 0; llama.cpp has no sparse kernels). Every other tensor is
F32 (norms always; the rest F16 / BF16 under a 16-bit save dtype), a layer left dense too.

Families: llama (SmolLM2 and other Llama-architecture checkpoints, written as GGUF's ``llama``
architecture, Q and K rows permuted as llama.cpp's converter permutes them for its rotary
layout: transformers' GGUF loader undoes it) and qwen2 (no permutation, q/k/v biases).
Refused in one line, before any work where the job can tell (:func:`refusal`): another family,
rotary scaling, Llama's attention/MLP biases, and layers that are not weight-only 4/8-bit,
symmetric, group 32 (asymmetric, 3-bit, another group size, int8 W8A8, low-rank, pruning alone).

The tokenizer: a fast byte-level BPE tokenizer (GPT-2 style: SmolLM2, Qwen2) as ``tokenizer.ggml``
``model: gpt2``, its tokens, token types (``CONTROL`` for special added tokens, ``USER_DEFINED``
for other added ones, ``UNUSED`` padding ids up to the model's vocabulary), merges, ``pre`` (the
pre-tokenizer llama.cpp must use, told from the tokenizer's own: :func:`pre_tokenizer`), the
BOS / EOS / UNK / PAD ids, whether BOS is added, and the chat template.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from lmcompress.errors import LmcompressError

logger = logging.getLogger(__name__)

GGUF_FILE = "model.gguf"
GROUP = 32  # Q4_0 / Q8_0 block size
BITS = (4, 8)
FAMILIES = {"llama": "llama", "qwen2": "qwen2"}  # HF model_type -> GGUF architecture
LOW_BIT_ATTRIBUTES = ("weight_codes", "scales", "zeros", "bits", "group_size", "symmetric")
LOW_BIT_FORMATS = ("int4", "nm_packed_int4")  # the formats whose layers have that form


# --- what GGUF can hold ----------------------------------------------------------------------


def family_refusal(config: Any) -> str | None:
    """Why a model of ``config`` has no GGUF form here (one line), or ``None``."""
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        return (
            f"--export gguf writes {' and '.join(FAMILIES)} models (transformers' GGUF loader "
            f"and llama.cpp read them), not {model_type}"
        )
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        return f"--export gguf: rotary scaling {rope.get('rope_type')!r} is not written"
    if model_type == "llama" and (
        getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False)
    ):
        return "--export gguf: a Llama with attention or MLP biases is not written"
    return None


def grid_refusal(bits: Any, group_size: Any, symmetric: Any) -> str | None:
    """Why a weight-only grid has no exact Q4_0 / Q8_0 form (one line), or ``None``."""
    if bits not in BITS:
        return f"--export gguf maps 4-bit (Q4_0) and 8-bit (Q8_0) codes, not {bits}-bit"
    if group_size != GROUP:
        return f"--export gguf needs --group-size {GROUP} (Q4_0/Q8_0 blocks), not {group_size}"
    if not symmetric:
        return "--export gguf needs a symmetric grid (Q4_0/Q8_0 have no zero points)"
    return None


def is_low_bit(module: nn.Module) -> bool:
    return all(hasattr(module, key) for key in LOW_BIT_ATTRIBUTES)


def layer_refusal(name: str, module: nn.Module) -> str | None:
    """Why a compressed layer has no exact Q4_0 / Q8_0 form (one line), or ``None``."""
    if getattr(module, "conv1d", False):
        return f"{name} is a GPT-2 Conv1D layer: not written to GGUF"
    if not is_low_bit(module):
        kind = getattr(module, "format", type(module).__name__)
        return (
            f"{name} is stored {kind}: --export gguf writes weight-only 4/8-bit layers "
            f"(symmetric, group {GROUP})"
        )
    why = grid_refusal(module.bits, module.group_size, module.symmetric)
    return f"{name}: {why}" if why else None


def refusal(config: Any, compressed: Mapping[str, nn.Module]) -> str | None:
    """Why this model and these compressed layers have no GGUF form, or ``None``."""
    return family_refusal(config) or next(
        (why for name, m in compressed.items() if (why := layer_refusal(name, m))), None
    )


# --- blocks ----------------------------------------------------------------------------------


def fp16_scales(scales: torch.Tensor) -> tuple[torch.Tensor, float]:
    """``scales`` as float16 and the largest relative change of rounding them (0.0: exact)."""
    half = scales.to(torch.float16)
    if not bool(torch.isfinite(half).all()) or bool((half == 0).any()):
        raise LmcompressError("a scale is outside float16's range: no Q4_0/Q8_0 form")
    change = ((half.float() - scales.float()).abs() / scales.float().abs()).max()
    return half, float(change) if scales.numel() else 0.0


def q4_0_blocks(codes: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """Codes uint8 ``(out, in)`` in ``[0, 15]`` (zero point 8) and float16 scales
    ``(out, in / 32)`` -> Q4_0 bytes ``(out, in / 32 · 18)``: per block ``d`` float16, then 16
    bytes, byte ``j`` holding code ``j`` (low nibble) and code ``j + 16`` (high nibble)."""
    rows, cols = codes.shape
    blocks = codes.reshape(rows, cols // GROUP, GROUP).to(torch.uint8)
    packed = blocks[..., :16] | (blocks[..., 16:] << 4)  # (out, blocks, 16)
    d = scales.to(torch.float16).contiguous().view(torch.uint8).view(rows, -1, 2)
    return torch.cat([d, packed], dim=-1).reshape(rows, -1).numpy()


def q8_0_blocks(codes: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """Codes uint8 ``(out, in)`` (zero point 128) and float16 scales -> Q8_0 bytes
    ``(out, in / 32 · 34)``: per block ``d`` float16, then the 32 codes minus 128 as int8."""
    rows, cols = codes.shape
    signed = (codes.to(torch.int16) - 128).to(torch.int8).view(torch.uint8)
    blocks = signed.reshape(rows, cols // GROUP, GROUP)
    d = scales.to(torch.float16).contiguous().view(torch.uint8).view(rows, -1, 2)
    return torch.cat([d, blocks], dim=-1).reshape(rows, -1).numpy()


def permute_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter's Q/K row order (``LlamaModel.permute``): within each head, the
    rotary pairs (i, i + d/2) of the HF layout become neighbours (2i, 2i + 1). Any tensor
    with one row per output feature (weights, codes, per-row scales)."""
    rows = weight.shape[0]
    return (
        weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


# --- the tokenizer ---------------------------------------------------------------------------

# the pre-tokenizers llama.cpp names, told from a fast tokenizer's own (its tokenizer.json)
_BYTE_LEVEL = {"type": "ByteLevel", "use_regex": True}


def pre_tokenizer(tokenizer: Any) -> str:
    """``tokenizer.ggml.pre``: ``gpt-2`` for GPT-2's byte-level regex alone, ``smollm`` for it
    after single digits (SmolLM/SmolLM2), ``qwen2`` for Qwen2's split; else ``default`` (llama.cpp
    then splits with GPT-2's regex), with a warning."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str()).get("pre_tokenizer") or {}
    parts = spec.get("pretokenizers", [spec]) if spec.get("type") == "Sequence" else [spec]

    def byte_level(part: dict) -> bool:
        return all(part.get(k) == v for k, v in _BYTE_LEVEL.items())

    if len(parts) == 1 and byte_level(parts[0]):
        return "gpt-2"
    if (
        len(parts) == 2
        and parts[0].get("type") == "Digits"
        and parts[0].get("individual_digits")
        and byte_level(parts[1])
    ):
        return "smollm"
    if parts and parts[0].get("type") == "Split" and "\\p{N}" in json.dumps(parts[0]):
        if getattr(tokenizer, "name_or_path", "") and "qwen" in tokenizer.name_or_path.lower():
            return "qwen2"
    logger.warning("the tokenizer's pre-tokenizer is not one llama.cpp names: written 'default'")
    return "default"


def tokenizer_fields(tokenizer: Any, vocab_size: int) -> dict[str, Any]:
    """The ``tokenizer.ggml.*`` values of a fast byte-level BPE tokenizer, the vocabulary
    padded to the model's ``vocab_size`` as llama.cpp's converter pads it."""
    from gguf import TokenType

    backend = getattr(tokenizer, "backend_tokenizer", None)
    model = json.loads(backend.to_str())["model"] if backend is not None else {}
    if model.get("type") != "BPE":
        raise LmcompressError(
            "--export gguf writes byte-level BPE tokenizers (GPT-2 style), not "
            f"{model.get('type') or type(tokenizer).__name__}"
        )
    by_id = {index: token for token, index in tokenizer.get_vocab().items()}
    if len(by_id) > vocab_size:
        raise LmcompressError(
            f"the tokenizer has {len(by_id)} tokens, more than the model's {vocab_size}"
        )
    added = tokenizer.added_tokens_decoder  # {id: AddedToken}
    tokens, types = [], []
    for index in range(vocab_size):
        if index not in by_id:
            tokens.append(f"[PAD{index}]")
            types.append(TokenType.UNUSED)
        elif index in added:
            tokens.append(by_id[index])
            types.append(TokenType.CONTROL if added[index].special else TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[index])
            types.append(TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    probe = tokenizer("a", add_special_tokens=True)["input_ids"]
    bos = tokenizer.bos_token_id
    fields = {
        "tokens": tokens,
        "types": types,
        "merges": merges,
        "pre": pre_tokenizer(tokenizer),
        "add_bos": bos is not None and probe[:1] == [bos],
        "ids": {
            key: getattr(tokenizer, f"{key}_token_id", None) for key in ("bos", "eos", "unk", "pad")
        },
        "chat_template": getattr(tokenizer, "chat_template", None),
    }
    return fields


# --- the file --------------------------------------------------------------------------------


def _hyperparameters(writer: Any, config: Any, arch: str) -> None:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = getattr(config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(getattr(config, "num_key_value_heads", config.num_attention_heads))
    writer.add_rope_freq_base(float(theta))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(config.vocab_size)
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)


def _tokenizer(writer: Any, fields: dict[str, Any]) -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(fields["pre"])
    writer.add_token_list(fields["tokens"])
    writer.add_token_types(fields["types"])
    writer.add_token_merges(fields["merges"])
    for key, token_id in fields["ids"].items():  # add_bos_token_id, add_eos_token_id, ...
        if token_id is not None:
            getattr(writer, f"add_{key}_token_id")(int(token_id))
    writer.add_add_bos_token(fields["add_bos"])
    if fields["chat_template"]:
        writer.add_chat_template(fields["chat_template"])


def _float_type(dtype: torch.dtype) -> tuple[Any, Any]:
    from gguf import GGMLQuantizationType as Q

    if dtype == torch.float16:
        return Q.F16, np.float16
    if dtype == torch.bfloat16:
        return Q.BF16, None
    return Q.F32, np.float32


def write_gguf(
    model: nn.Module,
    path: str | Path,
    compressed: Mapping[str, nn.Module],
    tokenizer: Any,
    dtype: torch.dtype | None = None,
    name: str | None = None,
) -> dict[str, Any]:
    """Write ``model`` (its low-bit ``compressed`` layers, in the model or beside it) to the GGUF
    file ``path``; return what was written: per tensor type a count, the largest relative
    change of a scale rounded to float16, the architecture and tokenizer ``pre``.

    ``dtype``: the type of the float tensors other than norms (float16 / bfloat16; else F32).
    Every check runs before the file is opened (:func:`refusal`, the tokenizer)."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    config = model.config
    if why := refusal(config, compressed):
        raise LmcompressError(why)
    if tokenizer is None:
        raise LmcompressError("--export gguf needs the model's tokenizer")
    fields = tokenizer_fields(tokenizer, config.vocab_size)
    arch = FAMILIES[config.model_type]
    tensors, worst = _tensors(model, compressed, arch, dtype or torch.float32)
    counts: dict[str, int] = {}
    for kind in (t[2] for t in tensors):
        counts[kind.name] = counts.get(kind.name, 0) + 1
    if worst:
        logger.warning(
            "GGUF stores scales as float16: rounded, largest relative change %.2e (the GGUF's "
            "weights differ from the runtime's by as much)",
            worst,
        )
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name or getattr(config, "_name_or_path", "") or arch)
    _hyperparameters(writer, config, arch)
    quantized = [k for k in counts if k.startswith("Q")]
    file_type = {
        "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
        "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    }.get(quantized[0] if len(quantized) == 1 else "", gguf.LlamaFileType.ALL_F32)
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _tokenizer(writer, fields)
    for tensor_name, array, kind in tensors:
        writer.add_tensor(tensor_name, array, raw_dtype=None if kind in (Q.F32, Q.F16) else kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    logger.info("wrote %s (%s)", path, ", ".join(f"{n} {k}" for k, n in counts.items()))
    return {
        "file": Path(path).name,
        "architecture": arch,
        "tensor_types": dict(sorted(counts.items())),
        "scale_fp16_max_relative_change": worst,
        "tokenizer_pre": fields["pre"],
    }


def _tensors(
    model: nn.Module, compressed: Mapping[str, nn.Module], arch: str, dtype: torch.dtype
) -> tuple[list[tuple[str, np.ndarray, Any]], float]:
    """``[(GGUF name, array, type)]`` of every tensor to write, and the largest relative change
    of a scale rounded to float16."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    config = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", heads)

    def rotary_heads(module_name: str) -> int | None:  # llama's permuted Q/K rows
        if arch != "llama" or not module_name.endswith(("q_proj", "k_proj")):
            return None
        return heads if module_name.endswith("q_proj") else kv_heads

    float_type, float_np = _float_type(dtype)
    tensors: list[tuple[str, np.ndarray, Any]] = []
    tied = getattr(config, "tie_word_embeddings", False)
    prefixes = tuple(f"{n}." for n in compressed)
    for key, value in model.state_dict().items():
        if key.startswith(prefixes) or (tied and key == "lm_head.weight"):
            continue
        module_name, _, suffix = key.rpartition(".")
        target = names.get_name(module_name)
        if target is None:
            raise LmcompressError(f"{key} has no GGUF tensor name for {arch}")
        tensor = value.detach().cpu()
        if count := rotary_heads(module_name):
            tensor = permute_rows(tensor, count)
        kind = Q.F32 if tensor.dim() == 1 else float_type
        tensors.append((f"{target}.{suffix}", _float_array(tensor, kind, float_np), kind))
    worst = 0.0
    for module_name, module in compressed.items():
        codes = module.weight_codes()
        half, change = fp16_scales(module.scales)
        worst = max(worst, change)
        if count := rotary_heads(module_name):
            codes, half = permute_rows(codes, count), permute_rows(half, count)
        kind = Q.Q4_0 if module.bits == 4 else Q.Q8_0
        blocks = (q4_0_blocks if module.bits == 4 else q8_0_blocks)(codes, half)
        target = names.get_name(module_name)
        tensors.append((f"{target}.weight", blocks, kind))
        bias = getattr(module, "bias", None)
        if bias is not None:
            tensors.append((f"{target}.bias", bias.detach().float().cpu().numpy(), Q.F32))
    return tensors, worst


def _float_array(tensor: torch.Tensor, kind: Any, float_np: Any) -> np.ndarray:
    from gguf import GGMLQuantizationType as Q

    if kind == Q.F32:
        return tensor.float().contiguous().numpy()
    if kind == Q.BF16:  # raw bytes: (rows, cols * 2) uint8
        return tensor.to(torch.bfloat16).contiguous().view(torch.uint8).numpy()
    return tensor.float().numpy().astype(float_np)
