"""Calibration text the model writes itself: ``--calib self`` (data-free, LLM-QAT's recipe).

Liu et al. 2023 (LLM-QAT, "Data-Free Quantization Aware Training for Large Language Models",
§2.1) distil a compressed model on text sampled from the dense one: the first token drawn
uniformly from the vocabulary, the next few chosen greedily (top-1), the rest sampled from the
full softmax. The samples follow the model's own training distribution rather than one corpus,
so what is learned on them is not tuned to Wikipedia (or any text the user happens to have).

Windows are generated ``batch_size`` at a time with the KV cache, on the model's device, in
its dtype; every random draw comes from one CPU ``torch.Generator`` seeded with ``seed``, so the
same model and seed give the same windows on every device.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import DynamicCache

from lmcompress.compressor.util.progress import bar_disabled
from lmcompress.errors import ConfigError

logger = logging.getLogger(__name__)

SELF_CORPUS = "self"
GREEDY_TOKENS = 3  # LLM-QAT: "the first 3~5 tokens" top-1, then sampled
KV_CACHE_BYTES = 1 << 30


def sample_windows(
    model: nn.Module,
    tokenizer: Any,
    nsamples: int,
    seq_len: int,
    seed: int = 0,
    batch_size: int | None = None,
    greedy_tokens: int = GREEDY_TOKENS,
) -> torch.Tensor:
    """``(nsamples, seq_len)`` int64 token ids (on the CPU) sampled from ``model``;
    ``batch_size`` windows at a time (default: as many as keep the KV cache within
    ``KV_CACHE_BYTES``, at most 32)."""
    if nsamples < 1 or seq_len < 2:
        raise ConfigError(
            f"--calib self needs nsamples >= 1 and seq_len >= 2, got {nsamples}, {seq_len}"
        )
    batch_size = batch_size or _batch_size(model, seq_len)
    generator = torch.Generator().manual_seed(seed)
    starts = _start_tokens(tokenizer, nsamples, generator)  # (nsamples,)
    device = next(model.parameters()).device
    was_training, start = model.training, time.perf_counter()
    model.eval()
    windows = []
    bar = tqdm(
        total=nsamples * seq_len, desc="sampling calibration text", unit="tok",
        disable=bar_disabled(),
    )  # fmt: skip
    try:
        with torch.inference_mode():
            for first in starts.split(batch_size):
                windows.append(_generate(model, first, seq_len, greedy_tokens, generator, device))
                bar.update(first.numel() * seq_len)
    finally:
        bar.close()
        model.train(was_training)
    seconds = time.perf_counter() - start
    logger.info(
        "sampled %d calibration windows of %d tokens from the model in %.0f s",
        nsamples, seq_len, seconds,
    )  # fmt: skip
    return torch.cat(windows)


def _batch_size(model: nn.Module, seq_len: int) -> int:
    """Windows per batch whose KV cache (keys and values of every layer) fits ``KV_CACHE_BYTES``."""
    config = model.config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    itemsize = next(model.parameters()).element_size()
    per_window = 2 * config.num_hidden_layers * heads * head_dim * itemsize * seq_len
    return max(1, min(32, KV_CACHE_BYTES // per_window))


def _start_tokens(tokenizer: Any, nsamples: int, generator: torch.Generator) -> torch.Tensor:
    """One first token per window, uniform over the tokenizer's ordinary (non-special) ids."""
    special = torch.tensor(sorted(set(tokenizer.all_special_ids)), dtype=torch.long)
    ordinary = torch.ones(len(tokenizer), dtype=torch.bool)
    ordinary[special[special < len(tokenizer)]] = False
    candidates = ordinary.nonzero().flatten()
    pick = torch.randint(0, candidates.numel(), (nsamples,), generator=generator)
    return candidates[pick]


def _generate(
    model: nn.Module,
    first: torch.Tensor,
    seq_len: int,
    greedy_tokens: int,
    generator: torch.Generator,
    device: torch.device,
) -> torch.Tensor:
    """``(len(first), seq_len)`` ids: ``first``, then ``greedy_tokens`` top-1, then sampled."""
    ids = torch.empty(first.numel(), seq_len, dtype=torch.long)
    ids[:, 0] = first
    step_input, cache = first[:, None].to(device), DynamicCache()
    for position in range(1, seq_len):
        logits = model(input_ids=step_input, cache=cache, use_cache=True).logits
        token = _next_token(logits[:, -1].float().cpu(), position <= greedy_tokens, generator)
        ids[:, position] = token
        step_input = token[:, None].to(device)
    return ids


def _next_token(logits: torch.Tensor, greedy: bool, generator: torch.Generator) -> torch.Tensor:
    """``(batch,)`` next ids from ``(batch, vocab)`` logits: top-1, or sampled from the softmax."""
    if greedy:
        return logits.argmax(dim=-1)
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).flatten()
