"""``compress(model, config, data)``: run one method on an in-memory model."""

from __future__ import annotations

import logging

import torch
from torch import nn

from lmcompress.compressor.config import MethodConfig
from lmcompress.compressor.method import Method, Stats
from lmcompress.compressor.report import CompressionReport
from lmcompress.errors import ConfigError
from lmcompress.methods import get_method

logger = logging.getLogger(__name__)


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
    method = get_method(config.method)(config, device=device)
    return run_method(method, model, data, return_stats=return_stats)


def run_method(
    method: Method,
    model: nn.Module,
    data: torch.Tensor | None = None,
    return_stats: bool = False,
) -> CompressionReport | tuple[CompressionReport, Stats]:
    """:func:`compress` with a method already built (the pipeline validates it on the model
    before loading any text, then runs the same instance)."""
    if method.needs_calibration and data is None:
        raise ConfigError(f"method {method.name!r} needs calibration data")
    model.eval()
    stats = method.calibrate(model, data)
    report = method.apply(model, stats)
    logger.info(
        "%s: %d layers compressed in %.1f s", method.name, len(report.layers), report.seconds
    )
    return (report, stats) if return_stats else report
