"""Calibration windows: the token windows a method calibrates on, cut from one tokenized text
by the SparseGPT protocol (the text comes from :mod:`lmcompress.evaluation.corpora`, the job
joins the two: :mod:`lmcompress.jobs.evaluate`)."""

from __future__ import annotations

import torch

from lmcompress.compressor.util.arguments import require
from lmcompress.errors import ConfigError, DataError


def calibration_windows(
    token_ids: torch.Tensor, nsamples: int, seq_len: int, seed: int = 0
) -> torch.Tensor:
    """(nsamples, seq_len) int64 windows of ``token_ids`` at random starts (SparseGPT protocol).

    Starts are uniform in ``[0, n - seq_len - 1]`` like SparseGPT's ``random.randint``, drawn
    from a ``torch.Generator`` seeded with ``seed``; windows may overlap.
    """
    require("token_ids", token_ids, torch.Tensor, "a 1-D tensor of token ids")
    require("nsamples", nsamples, int, "an int")
    require("seq_len", seq_len, int, "an int")
    if nsamples < 1 or seq_len < 1:
        raise ConfigError(f"nsamples and seq_len must be >= 1, got {nsamples} and {seq_len}")
    if token_ids.dim() != 1:
        raise ConfigError(f"token_ids must be 1-D, got shape {tuple(token_ids.shape)}")
    n = token_ids.numel()
    if n < seq_len + 1:
        raise DataError(
            f"the calibration corpus has {n} tokens; windows of {seq_len} need at "
            f"least {seq_len + 1}: use a larger corpus or a shorter seq_len"
        )
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, n - seq_len, (nsamples,), generator=generator)  # (nsamples,)
    index = starts[:, None] + torch.arange(seq_len)  # (nsamples, seq_len)
    return token_ids.long()[index.to(token_ids.device)]
