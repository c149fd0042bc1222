"""``compress(model, config, data)``: run one method on an in-memory model, inside a user's own
pipeline (``compress-model`` runs whole jobs: :mod:`lmcompress.jobs`)."""

from __future__ import annotations

import torch
from torch import nn

from lmcompress.compressor.config import MethodConfig
from lmcompress.compressor.method import Stats
from lmcompress.compressor.report import CompressionReport
from lmcompress.compressor.util.arguments import require
from lmcompress.methods import get_method


def compress(
    model: nn.Module,
    config: MethodConfig,
    data: torch.Tensor | None = None,
    device: str | torch.device | None = None,
    return_stats: bool = False,
) -> CompressionReport | tuple[CompressionReport, Stats]:
    """Compress ``model`` in place with the method ``config`` names.

    Args:
        data: calibration token ids (nsamples, seq_len) for methods that need them.
        device: where calibration computes (default: where the model is).
        return_stats: also return the calibration statistics (learned mask logits, ...).
    """
    require("model", model, nn.Module, "a torch.nn.Module (a transformers model)")
    require("config", config, MethodConfig, "a method config (MagnitudeConfig(...), ...)")
    require("data", data, (torch.Tensor, type(None)), "a tensor of token ids or None")
    method = get_method(config.method)(config, device=device)
    report, stats = method.compress(model, data)
    return (report, stats) if return_stats else report
