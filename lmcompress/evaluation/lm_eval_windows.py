"""Rolling (perplexity) requests of lm-eval scored by us: lm-eval's own windows of a document
(:func:`rolling_windows`), and their summed log-probabilities in one forward per batch without
the batch's full logits (:func:`window_logprobs`). The adapter
(:mod:`lmcompress.evaluation.lm_eval_adapter`) hands them lm-eval's requests."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from lmcompress.compressor.model.loss import default_chunk_tokens, final_hidden, head_logits


def rolling_windows(
    tokens: list[int], prefix_token: int, max_length: int
) -> list[tuple[list[int], list[int]]]:
    """``(inputs, targets)`` per window of a document, as lm-eval's rolling loglikelihood cuts
    it: the first window is the prefix token and the first ``max_length - 1`` tokens and
    predicts the first ``max_length``; each later one is the ``max_length`` tokens before its
    last target and predicts only tokens no window predicted yet. The targets are the next-token
    predictions of the last ``len(targets)`` positions of ``inputs``."""
    if not tokens:
        return []
    end = min(max_length, len(tokens))
    windows = [([prefix_token, *tokens[: end - 1]], tokens[:end])]
    while end < len(tokens):
        start, end = end, min(end + max_length, len(tokens))
        windows.append((tokens[end - max_length - 1 : end - 1], tokens[start:end]))
    return windows


@torch.no_grad()
def window_logprobs(
    model: torch.nn.Module, windows: list[tuple[list[int], list[int]]], device: Any
) -> list[float]:
    """Summed log-probability of each window's targets, one forward for the batch.

    Windows are right-padded to the longest (a causal model's earlier positions do not see the
    padding). Only the positions that predict a target reach the head, a chunk of rows at a
    time (:mod:`lmcompress.compressor.model.loss`): never the batch's ``B x T x V`` logits.
    """
    width = max(len(inputs) for inputs, _ in windows)
    ids = torch.tensor(
        [inputs + [inputs[0]] * (width - len(inputs)) for inputs, _ in windows], device=device
    )
    hidden = final_hidden(model, ids)  # (B, T, H)
    chunk = default_chunk_tokens(model.config.vocab_size)
    sums = []
    for row, (inputs, targets) in enumerate(windows):
        rows = hidden[row, len(inputs) - len(targets) : len(inputs)]  # (k, H), k = len(targets)
        labels = torch.tensor(targets, device=hidden.device)
        total = 0.0
        for at in range(0, len(targets), chunk):
            logits = head_logits(model, rows[at : at + chunk]).float()  # (chunk, V)
            nll = F.cross_entropy(logits, labels[at : at + chunk], reduction="sum")
            total -= nll.item()
        sums.append(total)
    return sums
