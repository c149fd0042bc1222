"""One attention function for every family, through which callers observe or transform the
attention probabilities.

transformers routes each family's attention through ``AttentionInterface``: the attention module
computes queries, keys and values (rotary, norms, GQA layout) and hands them to the function
named by ``config._attn_implementation``. Registering one function there, plus the matching
``AttentionMaskInterface`` entry (without it the model builds no mask for an unknown name and
silently runs *non-causal*), gives every supported family a single place where the softmax
output exists as a tensor: the int8-softmax method observes it during calibration and replaces
it (quantized, bias-corrected) during evaluation.

With no observer or transform the function is the families' eager attention, step for step:
GQA by repeating key/value heads, scores scaled by the ``scaling`` the module passes (OPT
pre-scales its queries and passes 1.0; GPT-2 folds ``scale_attn_weights`` and
``scale_attn_by_inverse_layer_idx`` into it), tanh softcap when the family passes one, the
additive mask (sliding windows live in the mask), softmax in float32 cast back to the query
dtype (GPT-2: softmax in the scores' dtype, cast to the value dtype; with
``reorder_and_upcast_attn`` the scores are computed in float32), dropout only in training.
The softcap follows the family's call, not its config: Gemma2 passes ``softcap``; Gemma3
(transformers 5.x) never passes its ``attn_logit_softcapping``, so its eager attention (and
sdpa) run without one, and so does this function.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from lmcompress.errors import ConfigError

logger = logging.getLogger(__name__)

IMPLEMENTATION = "lmcompress_hooked"

ProbsObserver = Callable[[nn.Module, torch.Tensor], None]  # (module, probs (B, H, Tq, Tk))
ProbsTransform = Callable[[nn.Module, torch.Tensor], torch.Tensor]  # same shape back
# (module, scores (B, H, Tq, Tk) before the mask, additive mask or None) -> probabilities
ScoresSoftmax = Callable[[nn.Module, torch.Tensor, torch.Tensor | None], torch.Tensor]

_registered = False


@dataclass(eq=False)
class AttentionHook:
    """What one ``attention_hook`` block installed; ``name(module)`` is the attention module's
    qualified name in the hooked model (for per-layer statistics keyed like everything else).
    ``observe`` and ``transform`` are read at every call, so they may be set inside the block."""

    observe: ProbsObserver | None = None
    transform: ProbsTransform | None = None
    names: dict[int, str] = field(default_factory=dict)  # id(module) -> qualified name
    # replaces the softmax itself (scores and mask in, probabilities out): an op that computes
    # quantized probabilities from the scores, as a deployment kernel does
    softmax: ScoresSoftmax | None = None
    previous: str | None = None  # the model's attention implementation before the hook

    def name(self, module: nn.Module) -> str | None:
        return self.names.get(id(module))


# module -> hooks active on it, outermost first. Keyed by module (not config) so that
# blocks run directly, and sub-models with their own config, find their model's hooks; weakly,
# so that a model dropped with a transform still installed leaves no entry behind (an entry
# keyed by a dead module's ``id`` would be found by a new module that reuses the address).
_ACTIVE: weakref.WeakKeyDictionary[nn.Module, list[AttentionHook]] = weakref.WeakKeyDictionary()


def layer_index(module: nn.Module) -> int | None:
    """The decoder layer an attention module belongs to, where the family records it."""
    index = getattr(module, "layer_idx", None)
    return int(index) if index is not None else None


def _additive_mask(
    mask: torch.Tensor | None, module: nn.Module, scores: torch.Tensor
) -> torch.Tensor | None:
    """The mask as eager attention adds it: float (B|1, 1, Tq, Tk), 0 = attend, dtype min = not.

    Masks built for other implementations reach us when blocks run on inputs captured before the
    hook was set: sdpa gives booleans (True = attend), or ``None`` when it relies on its own
    ``is_causal`` (only done for causal masks without padding or window, so a plain causal mask
    is the exact equivalent).
    """
    q_len, k_len = scores.shape[-2:]
    if mask is None:
        if q_len == 1 or not getattr(module, "is_causal", False):
            return None
        keep = torch.ones(q_len, k_len, dtype=torch.bool, device=scores.device)
        mask = keep.tril(k_len - q_len)[None, None]  # (1, 1, Tq, Tk), bottom-right aligned
    if mask.dtype == torch.bool:
        zeros = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)
        mask = zeros.masked_fill(~mask, torch.finfo(scores.dtype).min)
    return mask[..., :k_len]


def _upcast_scores(query: torch.Tensor, key: torch.Tensor, scaling: float) -> torch.Tensor:
    """GPT-2's ``reorder_and_upcast_attn`` scores: float32, autocast off, the scale applied
    inside ``baddbmm`` (as GPT-2 does, so the rounding is the same). (B, H, Tq, Tk)"""
    b, h, q_len, d = query.shape
    k_len = key.shape[2]
    with torch.autocast(query.device.type, enabled=False):
        out = torch.empty(b * h, q_len, k_len, dtype=torch.float32, device=query.device)
        q = query.reshape(-1, q_len, d).float()  # (B·H, Tq, D)
        k = key.transpose(-1, -2).reshape(-1, d, k_len).float()  # (B·H, D, Tk)
        out = torch.baddbmm(out, q, k, beta=0, alpha=scaling)
    return out.reshape(b, h, q_len, k_len)


def eager_attention(
    module: nn.Module,
    query: torch.Tensor,  # (B, H, Tq, D)
    key: torch.Tensor,  # (B, Hkv, Tk, D)
    value: torch.Tensor,  # (B, Hkv, Tk, D)
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    observe: ProbsObserver | None = None,
    transform: ProbsTransform | None = None,
    softmax: ScoresSoftmax | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager attention with the probabilities exposed: ``observe(module, probs)`` sees what the
    family's softmax produced, ``transform(module, probs)`` returns what the model uses instead;
    ``softmax(module, scores, mask)``, if given, computes the probabilities in place of the
    family's softmax (cast to the query's dtype).

    Returns ``(output (B, Tq, H, D), probs (B, H, Tq, Tk))`` as every family's eager function.
    """
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # GQA: every key/value head serves ``groups`` consecutive query heads
        key = key.repeat_interleave(groups, dim=1)  # (B, H, Tk, D)
        value = value.repeat_interleave(groups, dim=1)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    # GPT-2 keeps its own rules (the only family whose attention has this attribute).
    gpt2_style = hasattr(module, "reorder_and_upcast_attn")
    if gpt2_style and module.reorder_and_upcast_attn:
        scores = _upcast_scores(query, key, scaling)
    else:
        scores = torch.matmul(query, key.transpose(-1, -2)) * scaling  # (B, H, Tq, Tk)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    mask = _additive_mask(attention_mask, module, scores)
    out_dtype = value.dtype if gpt2_style else query.dtype
    if softmax is not None:
        probs = softmax(module, scores, mask).to(out_dtype)
    elif gpt2_style:
        scores = scores if mask is None else scores + mask
        probs = nn.functional.softmax(scores, dim=-1).type(out_dtype)
    else:
        scores = scores if mask is None else scores + mask
        probs = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(out_dtype)
    if observe is not None:
        observe(module, probs)
    if transform is not None:
        probs = transform(module, probs)
    probs = nn.functional.dropout(probs, p=dropout, training=module.training)
    output = torch.matmul(probs, value).transpose(1, 2).contiguous()  # (B, Tq, H, D)
    return output, probs


def hooked_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The registered ``AttentionInterface`` function: eager attention plus the hooks active on
    ``module`` (nested ``attention_hook`` blocks compose, outermost first). Other keyword
    arguments (``sliding_window``: already in the mask; position ids) are not needed."""
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("attention sinks (s_aux) are not supported by the hook")
    hooks = _ACTIVE.get(module, ())
    observers = [h.observe for h in hooks if h.observe is not None]
    transforms = [h.transform for h in hooks if h.transform is not None]
    softmaxes = [h.softmax for h in hooks if h.softmax is not None]
    if len(softmaxes) > 1:
        raise ConfigError("two hooks replace the softmax of one attention module")

    def observe(mod: nn.Module, probs: torch.Tensor) -> None:
        for fn in observers:
            fn(mod, probs)

    def transform(mod: nn.Module, probs: torch.Tensor) -> torch.Tensor:
        for fn in transforms:
            probs = fn(mod, probs)
        return probs

    return eager_attention(
        module,
        query,
        key,
        value,
        attention_mask,
        scaling=scaling,
        dropout=dropout,
        softcap=softcap,
        observe=observe if observers else None,
        transform=transform if transforms else None,
        softmax=softmaxes[0] if softmaxes else None,
    )


def register() -> str:
    """Register the function and its eager mask under :data:`IMPLEMENTATION` (once, on first
    use: registration is process-global). Returns the implementation name."""
    global _registered
    if not _registered:
        AttentionInterface.register(IMPLEMENTATION, hooked_attention)
        AttentionMaskInterface.register(IMPLEMENTATION, eager_mask)
        _registered = True
        logger.debug("registered attention implementation %s", IMPLEMENTATION)
    return IMPLEMENTATION


@contextlib.contextmanager
def attention_hook(
    model: nn.Module,
    observe: ProbsObserver | None = None,
    transform: ProbsTransform | None = None,
) -> Iterator[AttentionHook]:
    """Route ``model``'s attention through :func:`hooked_attention` inside the ``with`` block.

    ``observe(module, probs)`` is called with each attention module's probabilities
    (B, H, Tq, Tk) before ``transform(module, probs) -> probs`` replaces them; ``module`` tells
    the layer (:func:`layer_index`, or ``hook.name(module)``). Blocks of the model run directly
    (layer-wise calibration) go through the hook too. The previous attention implementation is
    restored on exit, also when the block raises.
    """
    hook = open_hook(model, observe, transform)
    try:
        yield hook
    finally:
        close_hook(model, hook)


def open_hook(
    model: nn.Module,
    observe: ProbsObserver | None = None,
    transform: ProbsTransform | None = None,
    softmax: ScoresSoftmax | None = None,
) -> AttentionHook:
    """:func:`attention_hook` without the ``with`` block: the hook stays until
    :func:`close_hook` (a transform that is part of the compressed model, such as an 8-bit
    softmax, lives as long as the model)."""
    if not hasattr(model, "set_attn_implementation"):
        raise ConfigError(f"{type(model).__name__} has no set_attn_implementation: not a HF model")
    names = {id(m): n for n, m in model.named_modules()}
    hook = AttentionHook(observe, transform, names, softmax=softmax)
    hook.previous = model.config._attn_implementation
    model.set_attn_implementation(register())
    for module in model.modules():
        _ACTIVE.setdefault(module, []).append(hook)
    return hook


def close_hook(model: nn.Module, hook: AttentionHook) -> None:
    """Remove ``hook``; the model's previous attention implementation comes back once no hook
    of it is left."""
    for module in model.modules():
        active = _ACTIVE.get(module, [])
        if hook in active:
            active.remove(hook)
        if not active:
            _ACTIVE.pop(module, None)
    if not any(module in _ACTIVE for module in model.modules()):
        model.set_attn_implementation(hook.previous)
