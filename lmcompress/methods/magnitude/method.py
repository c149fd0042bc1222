"""Magnitude pruning: no calibration data, importance score = |W|."""

from __future__ import annotations

import time

from torch import nn

from lmcompress.compressor.model.surgery import weight_matrix
from lmcompress.compressor.report import LayerReport
from lmcompress.methods.common import prune_layer_
from lmcompress.methods.layerwise import OneShotMethod
from lmcompress.methods.magnitude.config import MagnitudeConfig
from lmcompress.methods.magnitude.prior import magnitude_mask
from lmcompress.methods.pruning import PruningMethod


class Magnitude(OneShotMethod, PruningMethod):
    config_class = MagnitudeConfig
    needs_calibration = False
    streams = True

    def compress_layer(self, model: nn.Module, name: str, module: nn.Module) -> LayerReport:  # noqa: ARG002
        start = time.perf_counter()
        sparsity = self.config.sparsity_of(name)
        keep = magnitude_mask(weight_matrix(module).detach(), None, sparsity)
        return prune_layer_(name, module, keep, sparsity, start)
