"""Export W8A8 int8 layers in the compressed-tensors ``int-quantized`` layout.

A directory written by :func:`write_compressed_tensors` is what llm-compressor writes for a W8A8
int8 scheme, so ``transformers`` with ``compressed-tensors`` installed (0.20.x) loads it with a
plain ``AutoModelForCausalLM.from_pretrained``, and vLLM-style servers read the same layout:

- ``model.safetensors``: for every quantized layer ``<name>.weight`` int8 ``(out, in)``,
  ``<name>.weight_scale`` fp32 ``(out, 1)`` (or ``(out, in / group_size)``),
  ``<name>.input_scale`` fp32 ``(1,)`` for static activations, ``<name>.bias`` if any; every
  other parameter as the model has it.
- ``config.json``: the model's config plus ``quantization_config`` (see
  :func:`quantization_config`).

What the format cannot say (the 8-bit softmax and its bias correction) is not written here:
``compression.json`` holds it and ``load_compressed`` restores it.

How compressed-tensors 0.20.1 computes, read from its source (``quantization/lifecycle/
forward.py``, ``quantization/utils/helpers.py``), so that a simulation can match it:

- weights: ``weight * weight_scale`` in fp32 at the first forward (no int8 kernels on CPU);
- dynamic per-token activations (``strategy: token``): per token (all but the first two dims
  of a ``(batch, seq, hidden)`` input) ``scale = max(|min(x, 0)|, max(x, 0)) / 127.5`` (its
  "bit range / 2" with range ``[-128, 127]``), a zero scale replaced by ``finfo(fp32).eps``,
  then ``round(clamp(x / scale, -128, 127)) * scale`` with ``torch.round`` (half to even).
  The divisor 127.5 (not 127) and the reachable ``-128`` differ from an ``absmax / 127``
  symmetric scheme (and from vLLM's int8 kernels, which use ``absmax / 127``): the logits of a
  model quantized with one and evaluated with the other differ by quantization noise;
- static per-tensor activations (``strategy: tensor``): the stored ``input_scale``, the same
  clamp to ``[-128, 127]`` and round.

GPT-2's ``Conv1D`` layers are refused: compressed-tensors only quantizes ``nn.Linear``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmcompress.compressor.formats.base import CompressedLinear
from lmcompress.compressor.io.layout import update_config_json
from lmcompress.compressor.io.shards import cast_state, cast_tensor
from lmcompress.compressor.model.surgery import is_linear
from lmcompress.errors import LmcompressError

logger = logging.getLogger(__name__)

QUANT_METHOD = "compressed-tensors"
FORMAT = "int-quantized"
BITS = 8


def _args(strategy: str, dynamic: bool, group_size: int | None = None) -> dict[str, Any]:
    """One compressed-tensors ``QuantizationArgs``: signed symmetric 8-bit integers."""
    return {
        "num_bits": BITS,
        "type": "int",
        "symmetric": True,
        "strategy": strategy,
        "group_size": group_size,
        "block_structure": None,
        "dynamic": dynamic,
        "actorder": None,
        "observer": None if dynamic else "minmax",
        "observer_kwargs": {},
    }


def layer_scheme(name: str, module: nn.Module) -> dict[str, Any]:
    """The compressed-tensors scheme (``weights`` and ``input_activations`` args) of one
    quantized layer, checked: int8 weights with per-channel or per-group fp32 scales, and a
    positive static ``input_scale`` or none (dynamic per-token activations)."""
    if getattr(module, "conv1d", False):
        raise LmcompressError(
            f"{name} is a GPT-2 Conv1D layer: compressed-tensors quantizes nn.Linear only"
        )
    weight_q, scale = module.weight_q, module.weight_scale
    if weight_q.dtype != torch.int8 or weight_q.dim() != 2:
        raise LmcompressError(f"{name}: weight_q must be 2-D int8, got {weight_q.dtype}")
    out_features, in_features = weight_q.shape
    groups = scale.shape[-1] if scale.dim() == 2 else 0
    if scale.shape[0] != out_features or groups < 1 or in_features % groups:
        raise LmcompressError(
            f"{name}: weight_scale {list(scale.shape)} does not fit weight "
            f"{[out_features, in_features]}"
        )
    if groups == 1:
        weights = _args("channel", dynamic=False)
    else:
        weights = _args("group", dynamic=False, group_size=in_features // groups)
    input_scale = getattr(module, "input_scale", None)
    if input_scale is None:
        activations = _args("token", dynamic=True)
    else:
        if input_scale.numel() != 1 or not bool(input_scale.reshape(()) > 0):
            raise LmcompressError(f"{name}: input_scale must be one positive number")
        activations = _args("tensor", dynamic=False)
    return {"weights": weights, "input_activations": activations, "output_activations": None}


def layer_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """The layer's tensors under compressed-tensors' names (short keys, no module prefix):
    ``weight`` int8, ``weight_scale`` fp32, ``input_scale`` fp32 ``(1,)``, ``bias``."""
    tensors = {
        "weight": module.weight_q.detach().contiguous(),
        "weight_scale": module.weight_scale.detach().to(torch.float32).contiguous(),
    }
    if getattr(module, "input_scale", None) is not None:
        tensors["input_scale"] = module.input_scale.detach().to(torch.float32).reshape(1)
    if getattr(module, "bias", None) is not None:
        tensors["bias"] = module.bias.detach()
    return tensors


def linear_names(model: nn.Module) -> list[str]:
    """Names of every linear position of the architecture, in model order: plain layers and
    compressed replacements (a fresh ``from_pretrained`` builds an ``nn.Linear`` there)."""
    return [
        name
        for name, module in model.named_modules()
        if is_linear(module) or isinstance(module, CompressedLinear)
    ]


def quantization_config(model: nn.Module, quantized: dict[str, nn.Module]) -> dict[str, Any]:
    """``config.json``'s ``quantization_config`` for ``quantized`` layers of ``model``.

    One scheme for all layers gives llm-compressor's usual ``group_0`` targeting ``Linear``
    with every other linear (``lm_head`` at least) in ``ignore``; several schemes (e.g. static
    and dynamic layers mixed) give one group per scheme targeting its layers by name.
    """
    schemes: dict[str, dict[str, Any]] = {}
    members: dict[str, list[str]] = {}
    for name, module in quantized.items():
        scheme = layer_scheme(name, module)
        key = json.dumps(scheme, sort_keys=True)
        schemes.setdefault(key, scheme)
        members.setdefault(key, []).append(name)
    if not schemes:
        raise LmcompressError("no quantized layer to export in the compressed-tensors layout")
    single = len(schemes) == 1
    groups = {
        f"group_{i}": {"targets": ["Linear"] if single else members[key], **schemes[key]}
        for i, key in enumerate(schemes)
    }
    return {
        "quant_method": QUANT_METHOD,
        "format": FORMAT,
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": [name for name in linear_names(model) if name not in quantized],
        "kv_cache_scheme": None,
    }


def write_compressed_tensors(
    model: nn.Module,
    out_dir: str | Path,
    quantized: dict[str, nn.Module],
    dtype: torch.dtype | None = None,
) -> dict[str, Any]:
    """Write ``model`` with its ``quantized`` layers (``{name: QuantLinear}``, in the model or
    encoded beside it) into ``out_dir`` as ``config.json`` + ``model.safetensors`` in the
    compressed-tensors ``int-quantized`` layout; return the ``quantization_config`` written.

    ``out_dir`` is expected to be a fresh temporary directory (the caller's ``atomic_dir``).
    ``dtype`` is the storage dtype of the floating-point tensors that are not scales (``None``:
    the model's); int8 weights and fp32 scales keep theirs.
    """
    unknown = [name for name in quantized if name not in set(linear_names(model))]
    if unknown:
        raise LmcompressError(f"not linear layers of the model: {', '.join(unknown)}")
    config = quantization_config(model, quantized)
    dtype = dtype or next(model.parameters()).dtype
    prefixes = tuple(f"{name}." for name in quantized)
    state = cast_state(
        {k: v for k, v in model.state_dict().items() if not k.startswith(prefixes)}, dtype
    )
    for name, module in quantized.items():
        for key, value in layer_tensors(module).items():
            state[f"{name}.{key}"] = cast_tensor(value, dtype) if key == "bias" else value.cpu()
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True, state_dict=state)
    update_config_json(out_dir, dtype=str(dtype).removeprefix("torch."), quantization_config=config)
    logger.info(
        "wrote %d int8 layers in the compressed-tensors layout to %s", len(quantized), out_dir
    )
    return config


def fake_quantize_input(x: torch.Tensor, input_scale: torch.Tensor | None) -> torch.Tensor:
    """compressed-tensors' activation fake quantization, bit for bit (float, ``x``'s dtype):
    static ``input_scale``, or dynamic ``absmax / 127.5`` per token of a ``(batch, seq, in)``
    input and per tensor of a 2-D one (its ``strategy: token`` reduces dims 2.. only)."""
    if input_scale is not None:
        scale = input_scale
    else:
        dims = tuple(range(2, x.dim()))
        if dims:
            low, high = x.amin(dim=dims, keepdim=True), x.amax(dim=dims, keepdim=True)
        else:
            low, high = torch.aminmax(x)
        scale = torch.maximum(-low.clamp(max=0), high.clamp(min=0)) / 127.5
        scale = torch.where(scale == 0, torch.finfo(scale.dtype).eps, scale)
    return torch.round(torch.clamp(x / scale, -128, 127)) * scale


def simulated_linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What a model loaded from this layout computes for ``module`` (a QuantLinear): float32
    dequantized weights, :func:`fake_quantize_input`, ``F.linear``. Use it as the reference
    for interop checks: a float64 matmul or another activation scale gives other rounding
    flips, which on SmolLM2-135M move perplexity by 1e-3 to 5e-3 relative."""
    groups = module.weight_scale.shape[-1]
    codes = module.weight_q.float().unflatten(-1, (groups, -1))  # (out, groups, group_size)
    W = (codes * module.weight_scale.float().unsqueeze(-1)).flatten(-2)  # (out, in)
    x = fake_quantize_input(x, getattr(module, "input_scale", None))
    return nn.functional.linear(x, W.to(x.dtype), module.bias)
