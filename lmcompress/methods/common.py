"""Wiring the methods share: apply a mask and report it; the held-out perplexity a learned
method's training measures (handed to the core's drivers as their ``score``)."""

from __future__ import annotations

import torch
from torch import nn

from lmcompress.compressor.config import Sparsity
from lmcompress.compressor.model.surgery import weight_matrix
from lmcompress.compressor.report import LayerReport
from lmcompress.evaluation.perplexity import perplexity
from lmcompress.kernels.reference import packed_nm_nbytes


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def held_out_perplexity(model: nn.Module, eval_data: torch.Tensor | None):
    """A function that measures ``model``'s perplexity on the held-out windows ``eval_data``
    (N, L) as ``{"hard_ppl": ...}`` each time it is called (the drivers' ``Score``); ``None``
    without held-out windows."""
    if eval_data is None:
        return None

    def score() -> dict[str, float]:
        result = perplexity(model, eval_data.flatten(), eval_data.shape[1], progress=False)
        return {"hard_ppl": result.perplexity}

    return score


def hard_perplexity(model: nn.Module, eval_data: torch.Tensor | None) -> dict[str, float]:
    """The held-out perplexity of ``model`` as it is (its masks baked); ``{}`` without
    held-out windows."""
    score = held_out_perplexity(model, eval_data)
    return score() if score is not None else {}


@torch.no_grad()
def prune_layer_(
    name: str,
    module: nn.Module,
    keep: torch.Tensor,
    sparsity: Sparsity,
    started: float,
    new_weight: torch.Tensor | None = None,
) -> LayerReport:
    """Zero the weights of ``module`` where ``keep`` (bool, (out, in)) is False, in place.

    ``new_weight`` (out, in), if given, replaces the weight first (methods that update the
    surviving weights, e.g. SparseGPT). The reported error is relative to the original weight.
    """
    W = weight_matrix(module)  # (out, in), a view for GPT-2's Conv1D
    original = W.detach().clone()
    if new_weight is not None:
        W.copy_(new_weight.to(W.dtype))
    W.mul_(keep.to(W.dtype))
    numel, kept = W.numel(), int(keep.sum())
    if sparsity.is_nm:
        compressed = packed_nm_nbytes(tuple(W.shape), sparsity.n, sparsity.m, W.dtype)
    else:  # kept values plus a one-bit-per-weight bitmap
        compressed = kept * W.element_size() + (numel + 7) // 8
    return LayerReport.measure(
        name,
        original,
        W,
        started,
        params_kept=kept,
        bytes_compressed=compressed,
        sparsity=1.0 - kept / numel,
        pattern=str(sparsity),
        error_kind="weight",
        format="nm_packed" if sparsity.is_nm else None,
        format_options={"n": sparsity.n, "m": sparsity.m} if sparsity.is_nm else {},
    )
