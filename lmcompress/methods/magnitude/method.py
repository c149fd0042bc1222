"""Magnitude pruning: no calibration data, importance score = |W|."""

from __future__ import annotations

import time

from torch import nn
from tqdm.auto import tqdm

from lmcompress.compressor.method import Stats
from lmcompress.compressor.report import CompressionReport
from lmcompress.compressor.surgery import weight_matrix
from lmcompress.methods.common import count_params, prune_layer_
from lmcompress.methods.magnitude.config import MagnitudeConfig
from lmcompress.methods.magnitude.prior import magnitude_mask
from lmcompress.methods.pruning import PruningMethod


class Magnitude(PruningMethod):
    config_class = MagnitudeConfig
    needs_calibration = False

    def apply(self, model: nn.Module, stats: Stats) -> CompressionReport:  # noqa: ARG002
        start = time.perf_counter()
        layers = self.validate(model)
        report = CompressionReport(
            self.name, self.config.to_dict(), model_params=count_params(model)
        )
        for name, module in tqdm(layers.items(), desc="magnitude", unit="layer"):
            layer_start = time.perf_counter()
            sparsity = self.config.sparsity_of(name)
            keep = magnitude_mask(weight_matrix(module).detach(), None, sparsity)
            report.layers.append(prune_layer_(name, module, keep, sparsity, layer_start))
        report.seconds = time.perf_counter() - start
        return report
