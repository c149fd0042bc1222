"""SmoothQuant (Xiao et al., ICML 2023): move activation outliers into the weights before W8A8.

A few input channels of some linears carry values 10-100x larger than the rest, in every token;
per-token int8 scales are set by those channels and the others lose their resolution. For a
linear ``y = x Wᵀ`` and a per-channel factor ``s``, ``y = (x / s)(W · s)ᵀ``: dividing channel
``j`` of the input by ``s_j = max|x_j|^α / max|W[:, j]|^(1−α)`` and multiplying column ``j`` of
the weight by it flattens the activations at the price of the weights (which quantize per
output channel, and have resolution to spare). The division is folded into whatever produces
the input, so the model computes exactly the same function in float:

- a norm's weight (and bias) before the linears it feeds (attention q/k/v; MLP gate/up);
- ``up_proj``'s output rows before ``down_proj`` (``act(gate) * up`` is linear in ``up``).

Supported: the Llama-style families (llama, mistral, qwen2, qwen3), whose blocks name these
modules ``input_layernorm``, ``post_attention_layernorm`` and ``mlp.{gate,up,down}_proj``
(Qwen3's per-head q/k norms act on q_proj's and k_proj's outputs, which smoothing leaves
unchanged). The
statistics are the per-channel absmax of each group's input on the calibration windows.
"""

from __future__ import annotations

import torch
from torch import nn

from lmcompress.compressor.model.families import decoder_blocks, family_of
from lmcompress.errors import ConfigError

SMOOTHABLE = ("llama", "mistral", "qwen2", "qwen3")
# (producer of the input, the linears that read it), relative to a decoder block
GROUPS = (
    ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
    ("mlp.up_proj", ("mlp.down_proj",)),
)


def check_smoothable(model: nn.Module) -> None:
    model_type = model.config.model_type
    if model_type not in SMOOTHABLE:
        raise ConfigError(
            f"--smooth-alpha supports {', '.join(SMOOTHABLE)} models, not {model_type!r}"
        )


def smoothing_groups(model: nn.Module) -> list[tuple[str, list[str]]]:
    """``[(producer name, [linear names])]`` over every decoder block, qualified names."""
    check_smoothable(model)
    prefix = family_of(model).blocks
    return [
        (f"{prefix}.{i}.{producer}", [f"{prefix}.{i}.{name}" for name in consumers])
        for i in range(len(decoder_blocks(model)))
        for producer, consumers in GROUPS
    ]


def smoothing_factors(
    input_absmax: torch.Tensor, weights: list[torch.Tensor], alpha: float
) -> torch.Tensor:
    """``s_j = max|x_j|^α / max_i max|W_i[:, j]|^(1−α)`` over the group's (out, in) weights;
    channels that never fire (or have zero weights) keep ``s_j = 1``."""
    w_absmax = torch.stack([w.detach().abs().amax(dim=0).float() for w in weights]).amax(dim=0)
    x = input_absmax.float().clamp_min(1e-5)
    s = x.pow(alpha) / w_absmax.clamp_min(1e-5).pow(1 - alpha)
    keep = (input_absmax <= 0) | (w_absmax <= 0) | ~torch.isfinite(s)
    return torch.where(keep, torch.ones_like(s), s).clamp_min(1e-5)


@torch.no_grad()
def smooth_(
    model: nn.Module, input_absmax: dict[str, torch.Tensor], alpha: float
) -> dict[str, torch.Tensor]:
    """Smooth ``model`` in place; ``input_absmax[first linear of a group]`` is its input's
    per-channel absmax (in_features,). Returns ``{linear name: s}`` for every linear whose input
    is now divided by ``s`` (static activation ranges must be divided by it too)."""
    if not 0.0 < alpha < 1.0:
        raise ConfigError(f"smooth_alpha must lie strictly between 0 and 1, got {alpha}")
    factors: dict[str, torch.Tensor] = {}
    for producer_name, consumer_names in smoothing_groups(model):
        if consumer_names[0] not in input_absmax:
            continue
        producer = model.get_submodule(producer_name)
        consumers = [model.get_submodule(name) for name in consumer_names]
        s = smoothing_factors(input_absmax[consumer_names[0]], [c.weight for c in consumers], alpha)
        s = s.to(producer.weight.device)
        if isinstance(producer, nn.Linear):  # up_proj: its output rows feed down_proj
            producer.weight.div_(s.to(producer.weight.dtype).unsqueeze(1))
        else:  # a norm's per-channel weight
            producer.weight.div_(s.to(producer.weight.dtype))
        if getattr(producer, "bias", None) is not None:
            producer.bias.div_(s.to(producer.bias.dtype))
        for name, consumer in zip(consumer_names, consumers, strict=True):
            consumer.weight.mul_(s.to(consumer.weight.dtype))
            factors[name] = s.cpu()
    return factors
