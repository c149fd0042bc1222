"""Token perplexity by the SparseGPT / Wanda protocol.

The test documents are joined and tokenized once (see ``corpora.tokenize``), cut into
non-overlapping windows of ``seq_len`` tokens (the tail that does not fill a window is dropped),
and the mean next-token NLL over every predicted token is exponentiated. With ``stride <
seq_len`` windows overlap and each scores only the tokens the previous window did not (the
Hugging Face sliding-window recipe). Families that need BOS (Gemma) get it at the start of every
window, in place of the window's first token slot.

The NLL is computed from the final hidden states a chunk of positions at a time
(:func:`lmcompress.compressor.model.loss.chunked_nll`): with a 262k-token vocabulary the whole
batch's logits would be 2.1 GB at batch 4 x 512, and the peak now follows the chunk instead.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from lmcompress.compressor.model.loss import IGNORE_INDEX, chunked_nll
from lmcompress.compressor.util.arguments import require
from lmcompress.compressor.util.progress import bar_disabled
from lmcompress.errors import ConfigError, DataError


@dataclass
class PerplexityResult:
    perplexity: float
    nll: float  # mean negative log-likelihood per predicted token (nats)
    tokens: int  # number of predicted (scored) tokens
    windows: int
    seconds: float

    def to_dict(self) -> dict:
        return asdict(self)


def _windows(n_tokens: int, seq_len: int, stride: int) -> list[tuple[int, int, int]]:
    """(start, end, first scored position inside the window) for every window."""
    spans, prev_end = [], 0
    for start in range(0, n_tokens - seq_len + 1, stride):
        end = start + seq_len
        spans.append((start, end, max(prev_end - start, 0)))
        prev_end = end
    return spans


@torch.no_grad()
def perplexity(
    model: nn.Module,
    token_ids: torch.Tensor,
    seq_len: int,
    stride: int | None = None,
    batch_size: int = 4,
    bos_token_id: int | None = None,
    max_tokens: int | None = None,
    progress: bool = True,
    chunk_tokens: int | None = None,
) -> PerplexityResult:
    """Perplexity of ``model`` on 1-D ``token_ids``.

    Args:
        seq_len: window length in tokens (BOS included when ``bos_token_id`` is given).
        stride: step between window starts; ``None`` = ``seq_len`` (non-overlapping).
        bos_token_id: prepend this token to every window (families that need it).
        max_tokens: use only the first ``max_tokens`` tokens of the corpus (0/None = all).
        chunk_tokens: positions whose logits exist at once (default: ~64 MB of them, see
            :func:`lmcompress.compressor.model.loss.default_chunk_tokens`).
    """
    require("model", model, nn.Module, "a torch.nn.Module (a transformers model)")
    require("token_ids", token_ids, torch.Tensor, "a 1-D tensor of token ids")
    require("seq_len", seq_len, int, "an int")
    if token_ids.dim() != 1:
        raise ConfigError(f"token_ids must be 1-D, got shape {tuple(token_ids.shape)}")
    if seq_len < 2:
        raise ConfigError(f"seq_len must be at least 2, got {seq_len}")
    body = seq_len - (bos_token_id is not None)  # corpus tokens per window
    stride = body if stride is None else stride
    if not 0 < stride <= body:
        raise ConfigError(f"stride must lie in [1, {body}] (corpus tokens a window), got {stride}")
    if batch_size < 1:
        raise ConfigError(f"batch_size must be at least 1, got {batch_size}")
    ids = token_ids.flatten().long()
    if max_tokens:
        ids = ids[:max_tokens]
    spans = _windows(ids.numel(), body, stride)
    if not spans:
        raise DataError(f"corpus has {ids.numel()} tokens: too few for one window of {seq_len}")

    device = next(model.parameters()).device
    start_time = time.perf_counter()
    total_nll, total_tokens = 0.0, 0
    batches = range(0, len(spans), batch_size)
    for i in tqdm(batches, desc="perplexity", unit="batch", disable=bar_disabled(progress)):
        batch = spans[i : i + batch_size]
        inputs = torch.stack([ids[s:e] for s, e, _ in batch])  # (B, body)
        if bos_token_id is not None:
            inputs = F.pad(inputs, (1, 0), value=bos_token_id)  # (B, seq_len)
        inputs = inputs.to(device)
        labels = inputs.clone()  # (B, T): position t is scored on labels[:, t + 1]
        offset = bos_token_id is not None
        for row, (_, _, first) in enumerate(batch):
            # Tokens before `first` were scored by the previous window; the BOS is never a target.
            labels[row, : first + offset] = IGNORE_INDEX
        nll = chunked_nll(model, inputs, labels, chunk_tokens=chunk_tokens, reduction="sum")
        total_nll += float(nll)
        total_tokens += int((labels[:, 1:] != IGNORE_INDEX).sum())
    mean_nll = total_nll / total_tokens
    return PerplexityResult(
        perplexity=math.exp(mean_nll),
        nll=mean_nll,
        tokens=total_tokens,
        windows=len(spans),
        seconds=time.perf_counter() - start_time,
    )
