"""Losses over the vocabulary without the whole batch's logits.

A causal LM's logits are ``B x T x V`` numbers: at batch 4 x 512 with Gemma 3's 262,144-token
vocabulary that is 2.1 GB in fp32, and ``cross_entropy`` adds a log-softmax copy of the same
size (4.3 GB, twice the weights of a 270M model). Every loss here instead takes the final hidden
states (``B x T x H``, H is a few hundred) and runs head + log-softmax + loss over chunks of
``chunk_tokens`` positions, so the peak grows with the chunk, not with ``B x T x V``.

Under autograd, training (MaskLLM end to end, distillation) never holds the whole logits
either: a plain linear head's chunk computes its losses' gradients in the forward, while its
logits exist (:mod:`lmcompress.compressor.model.head_grad`), and keeps only their (positions x
hidden) product with the head; any other head's chunk runs under non-reentrant
:func:`torch.utils.checkpoint.checkpoint`, which keeps the chunk's inputs and recomputes its
logits in the backward.

The hidden states come from the model's own forward with a pre-hook on the head that records
its input and hands the head an empty ``(B, 0, H)`` slice: nothing but the head is skipped, for
every family. What the families do to the head's output is replayed on each chunk: Gemma 3's
``final_logit_softcapping`` (``tanh(z / c) * c``); none of the other supported families
post-processes its logits (checked against transformers 5.24's ``*ForCausalLM.forward``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lmcompress.compressor.model.families import family_of
from lmcompress.compressor.model.head_grad import HeadLosses
from lmcompress.errors import ConfigError

IGNORE_INDEX = -100
CHUNK_LOGIT_BYTES = 64 << 20
"""Target size of one chunk's fp32 logits. A chunk holds about three tensors of this size at
once (logits, log-softmax, and its gradient or the teacher's log-softmax), so ~200 MB of peak:
small next to any model with such a vocabulary, and large enough (341 positions for a
49,152-token vocabulary, 64 for 262,144) that the head's matmul stays efficient."""


def default_chunk_tokens(vocab_size: int) -> int:
    """Positions per chunk so that one chunk's fp32 logits take ~:data:`CHUNK_LOGIT_BYTES`."""
    return max(1, CHUNK_LOGIT_BYTES // (4 * vocab_size))


@dataclass(frozen=True)
class Head:
    """The output head as plain tensors, so a chunk's recomputation in the backward uses the
    same weight as its forward (a parametrized head is read once, inside the caller's
    ``parametrize.cached()``), and the family's post-processing."""

    weight: torch.Tensor | None  # (V, H) when the head is an nn.Linear
    bias: torch.Tensor | None
    module: nn.Module | None  # any other head (a compressed one) is called as a module
    softcap: float | None  # Gemma 3's final_logit_softcapping

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., H) -> (..., V) in the model's dtype, as ``*ForCausalLM.forward`` returns them."""
        if self.module is not None:
            z = self.module(hidden)
        else:
            z = F.linear(hidden, self.weight, self.bias)
        if self.softcap is not None:
            z = torch.tanh(z / self.softcap) * self.softcap
        return z

    def detached(self) -> Head:
        """The same head with no gradient path (a teacher's)."""
        return Head(
            weight=None if self.weight is None else self.weight.detach(),
            bias=None if self.bias is None else self.bias.detach(),
            module=self.module,
            softcap=self.softcap,
        )


def output_head(model: nn.Module) -> Head:
    """The head of a supported ``*ForCausalLM`` and its logit post-processing."""
    module = model.get_submodule(family_of(model).head)
    softcap = getattr(model.config, "final_logit_softcapping", None)
    if isinstance(module, nn.Linear):
        return Head(module.weight, module.bias, None, softcap)
    return Head(None, None, module, softcap)


def final_hidden(model: nn.Module, input_ids: torch.Tensor, **model_kwargs) -> torch.Tensor:
    """The hidden states that feed the head, ``(B, T, H)``, from one forward of ``model``.

    The head sees an empty ``(B, 0, H)`` input, so no logits are computed; the forward is
    otherwise the model's own (final norm, OPT's ``project_out``, dropout in train mode).
    """
    if "labels" in model_kwargs:
        raise ConfigError("final_hidden computes no loss: pass labels to chunked_nll instead")
    head = model.get_submodule(family_of(model).head)
    captured: list[torch.Tensor] = []

    def keep_input(_module: nn.Module, args: tuple) -> tuple:
        captured.append(args[0])
        return (args[0][..., :0, :], *args[1:])

    handle = head.register_forward_pre_hook(keep_input)
    try:
        model(input_ids=input_ids, use_cache=False, **model_kwargs)
    finally:
        handle.remove()
    if len(captured) != 1:
        raise RuntimeError(f"the head ran {len(captured)} times in one forward, expected once")
    return captured[0]


def _chunk_losses(
    hidden: torch.Tensor,
    targets: torch.Tensor | None,
    teacher_hidden: torch.Tensor | None,
    head: Head,
    teacher_head: Head | None,
    ignore_index: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed NLL and summed KL(teacher || student) of one chunk of rows, in float32.

    ``cross_entropy`` is ``nll_loss(log_softmax(z))``: computing it that way lets NLL and KL
    share the student's log-softmax.
    """
    logp = F.log_softmax(head.logits(hidden).float(), dim=-1)  # (n, V)
    zero = logp.new_zeros(())
    nll = zero
    if targets is not None:
        nll = F.nll_loss(logp, targets, ignore_index=ignore_index, reduction="sum")
    kl = zero
    if teacher_hidden is not None:
        with torch.no_grad():
            teacher_logp = F.log_softmax(teacher_head.logits(teacher_hidden).float(), dim=-1)
        kl = F.kl_div(logp, teacher_logp, log_target=True, reduction="sum")
    return nll, kl


def _needs_graph(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _run_chunks(
    head: Head,
    hidden: torch.Tensor,
    targets: torch.Tensor | None,
    teacher_hidden: torch.Tensor | None,
    teacher_head: Head | None,
    chunk_tokens: int,
    ignore_index: int,
    nll_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sums of :func:`_chunk_losses` over chunks of rows of ``hidden`` (N, H). Under autograd a
    plain linear head's chunks go through :class:`HeadLosses` (gradients in the forward; with
    ``nll_grad`` off the NLL has none), any other head's under checkpointing."""
    differentiable = _needs_graph(hidden, head.weight, head.bias)
    if head.module is not None:
        differentiable = differentiable or _needs_graph(*head.module.parameters())
    fused = differentiable and head.module is None and head.softcap is None
    nll = kl = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk_tokens):
        rows = slice(start, start + chunk_tokens)
        args = (
            hidden[rows],
            None if targets is None else targets[rows],
            None if teacher_hidden is None else teacher_hidden[rows],
            head,
            teacher_head,
            ignore_index,
        )
        if fused:
            chunk_nll, chunk_kl = _fused_chunk(*args, nll_grad)
        elif differentiable:  # keep only the chunk's inputs; recompute its logits in backward
            chunk_nll, chunk_kl = checkpoint(_chunk_losses, *args, use_reentrant=False)
        else:
            chunk_nll, chunk_kl = _chunk_losses(*args)
        nll, kl = nll + chunk_nll, kl + chunk_kl
    return nll, kl


def _fused_chunk(
    hidden: torch.Tensor,
    targets: torch.Tensor | None,
    teacher_hidden: torch.Tensor | None,
    head: Head,
    teacher_head: Head | None,
    ignore_index: int,
    nll_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_chunk_losses`' arguments, through :class:`HeadLosses`."""
    teacher_logits = None
    if teacher_hidden is not None:
        teacher_logits = lambda: teacher_head.logits(teacher_hidden)  # noqa: E731
    return HeadLosses.apply(
        hidden, head.weight, head.bias, targets, teacher_logits, ignore_index, nll_grad
    )


def _chunk_size(model: nn.Module, chunk_tokens: int | None) -> int:
    if chunk_tokens is None:
        return default_chunk_tokens(model.config.vocab_size)
    if chunk_tokens < 1:
        raise ConfigError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
    return chunk_tokens


def _shifted_targets(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """(B, T) labels -> (B, T) targets: position t predicts labels[t + 1]; the last, nothing."""
    return F.pad(labels[:, 1:], (0, 1), value=ignore_index)


def nll_from_hidden(
    model: nn.Module,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_tokens: int | None = None,
    reduction: Literal["sum", "mean"] = "sum",
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Next-token NLL of ``labels`` (B, T) given the final hidden states (B, T, H).

    ``labels`` follow the transformers convention (``labels=input_ids``; shifted here, so
    position t is scored on ``labels[:, t + 1]``; ``ignore_index`` entries are skipped).
    ``reduction="sum"`` is the float32 sum over scored tokens, ``"mean"`` divides it by their
    count and equals ``model(input_ids, labels=labels).loss``. Only scored positions reach the
    head.
    """
    if reduction not in ("sum", "mean"):
        raise ConfigError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
    chunk = _chunk_size(model, chunk_tokens)
    targets = _shifted_targets(labels.to(hidden.device), ignore_index).reshape(-1)  # (B*T,)
    rows = hidden.reshape(-1, hidden.shape[-1])  # (B*T, H)
    scored = targets != ignore_index
    if not bool(scored.all()):
        keep = scored.nonzero().squeeze(1)
        rows, targets = rows.index_select(0, keep), targets.index_select(0, keep)
    nll, _ = _run_chunks(output_head(model), rows, targets, None, None, chunk, ignore_index)
    return nll / targets.numel() if reduction == "mean" else nll


def chunked_nll(
    model: nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_tokens: int | None = None,
    reduction: Literal["sum", "mean"] = "sum",
    ignore_index: int = IGNORE_INDEX,
    **model_kwargs,
) -> torch.Tensor:
    """``model(input_ids, labels=labels).loss`` (``"mean"``, or times the number of scored
    tokens for ``"sum"``) computed ``chunk_tokens`` positions at a time; differentiable.

    Default chunk: :func:`default_chunk_tokens` of the vocabulary. ``model_kwargs`` (an
    ``attention_mask``, ...) go to the model's forward.
    """
    hidden = final_hidden(model, input_ids, **model_kwargs)  # (B, T, H)
    return nll_from_hidden(
        model,
        hidden,
        labels,
        chunk_tokens=chunk_tokens,
        reduction=reduction,
        ignore_index=ignore_index,
    )


def chunked_kl(
    model: nn.Module,
    hidden: torch.Tensor,
    teacher_hidden: torch.Tensor,
    *,
    teacher: nn.Module | None = None,
    chunk_tokens: int | None = None,
    reduction: Literal["batchmean", "sum"] = "batchmean",
) -> torch.Tensor:
    """KL(teacher || student) summed over every position, over ``B * T`` for ``"batchmean"``.

    Equals ``F.kl_div(log_softmax(student_logits), log_softmax(teacher_logits),
    log_target=True, reduction="batchmean")`` with both logits flattened to ``(B * T, V)``.
    ``hidden`` (B, T, H) is the student's (``model``'s) final hidden state;
    ``teacher_hidden`` goes through ``teacher``'s head (default: ``model``'s, as when the
    teacher is the same model with its masks disabled). The teacher gets no gradient.
    """
    if reduction not in ("batchmean", "sum"):
        raise ConfigError(f"reduction must be 'batchmean' or 'sum', got {reduction!r}")
    kl = _kl_and_nll(model, hidden, teacher_hidden, teacher, None, chunk_tokens, IGNORE_INDEX)[0]
    return kl / hidden.shape[:-1].numel() if reduction == "batchmean" else kl


def distillation_losses(
    model: nn.Module,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    teacher_hidden: torch.Tensor,
    *,
    teacher: nn.Module | None = None,
    chunk_tokens: int | None = None,
    ignore_index: int = IGNORE_INDEX,
    nll_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean next-token NLL, batchmean KL(teacher || student)) in one pass over the chunks.

    The same values as :func:`nll_from_hidden` (``"mean"``) and :func:`chunked_kl`, but each
    chunk's student logits and log-softmax serve both terms: with a large vocabulary the head
    is most of the model's compute. ``nll_grad=False``: the NLL is for logging only and comes
    back with no gradient path, which spares its gradient's matmul (a plain linear head).
    """
    targets = _shifted_targets(labels.to(hidden.device), ignore_index).reshape(-1)  # (B*T,)
    kl, nll = _kl_and_nll(
        model, hidden, teacher_hidden, teacher, targets, chunk_tokens, ignore_index, nll_grad
    )
    scored = (targets != ignore_index).sum()
    return nll / scored, kl / hidden.shape[:-1].numel()


def _kl_and_nll(
    model: nn.Module,
    hidden: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher: nn.Module | None,
    targets: torch.Tensor | None,
    chunk_tokens: int | None,
    ignore_index: int,
    nll_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed KL and NLL over every row of (B, T, H) ``hidden``."""
    if teacher_hidden.shape[:-1] != hidden.shape[:-1]:
        raise ConfigError(
            f"teacher positions {tuple(teacher_hidden.shape[:-1])} differ from the student's "
            f"{tuple(hidden.shape[:-1])}"
        )
    chunk = _chunk_size(model, chunk_tokens)
    teacher_head = output_head(model if teacher is None else teacher).detached()
    nll, kl = _run_chunks(
        output_head(model),
        hidden.reshape(-1, hidden.shape[-1]),  # (B*T, H)
        targets,
        teacher_hidden.detach().reshape(-1, teacher_hidden.shape[-1]),  # (B*T, H_teacher)
        teacher_head,
        chunk,
        ignore_index,
        nll_grad,
    )
    if not nll_grad:
        nll = nll.detach()  # the checkpointed path's too
    return kl, nll


def head_logits(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Logits of (..., H) hidden states through ``model``'s head, as its forward returns them
    (for a few positions: a whole batch's logits are what this module avoids)."""
    return output_head(model).logits(hidden)
