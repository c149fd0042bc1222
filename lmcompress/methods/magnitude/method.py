"""Magnitude pruning: no calibration data, importance score = |W|."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from lmcompress.compressor.calibration.layerwise import BlockSource, stream_blocks
from lmcompress.compressor.method import Stats
from lmcompress.compressor.model.families import family_of
from lmcompress.compressor.model.surgery import weight_matrix
from lmcompress.compressor.report import CompressionReport, LayerReport
from lmcompress.compressor.util.progress import bar_disabled
from lmcompress.errors import ConfigError
from lmcompress.methods.common import count_params, prune_layer_
from lmcompress.methods.magnitude.config import MagnitudeConfig
from lmcompress.methods.magnitude.prior import magnitude_mask
from lmcompress.methods.pruning import PruningMethod


class Magnitude(PruningMethod):
    config_class = MagnitudeConfig
    needs_calibration = False
    streams = True

    def apply(self, model: nn.Module, stats: Stats) -> CompressionReport:  # noqa: ARG002
        start = time.perf_counter()
        layers = self.validate(model)
        report = CompressionReport(
            self.name, self.config.to_dict(), model_params=count_params(model)
        )
        bars = {"desc": "magnitude", "unit": "layer", "disable": bar_disabled()}
        for name, module in tqdm(layers.items(), **bars):
            report.layers.append(self._prune(name, module))
        report.seconds = time.perf_counter() - start
        return report

    def compress_streaming(
        self,
        model: nn.Module,
        data: torch.Tensor | None,  # noqa: ARG002
        source: BlockSource,
        offload_dir: str | Path | None = None,  # noqa: ARG002
    ) -> CompressionReport:
        """:meth:`apply` on a meta-device skeleton, one block materialised at a time (layers
        outside the decoder blocks cannot be streamed: the skeleton never holds them)."""
        start = time.perf_counter()
        layers = self.validate(model)
        prefix = family_of(model).blocks
        outside = [name for name in layers if not name.startswith(prefix + ".")]
        if outside:
            raise ConfigError(f"--streaming compresses decoder blocks only, not {outside}")

        def prune_block(index: int, _block: nn.Module) -> list[LayerReport]:
            inside = f"{prefix}.{index}."
            return [self._prune(n, m) for n, m in layers.items() if n.startswith(inside)]

        report = CompressionReport(
            self.name, self.config.to_dict(), model_params=count_params(model)
        )
        report.layers = stream_blocks(model, source, prune_block)
        report.seconds = time.perf_counter() - start
        return report

    def _prune(self, name: str, module: nn.Module) -> LayerReport:
        start = time.perf_counter()
        sparsity = self.config.sparsity_of(name)
        keep = magnitude_mask(weight_matrix(module).detach(), None, sparsity)
        return prune_layer_(name, module, keep, sparsity, start)
