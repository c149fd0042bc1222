"""SparseGPT through the layer-wise loop: a Hessian per layer, then the OBS solver."""

from __future__ import annotations

import time

import torch
from torch import nn

from lmcompress.compressor.config import Sparsity
from lmcompress.compressor.model.surgery import weight_matrix
from lmcompress.compressor.report import LayerReport
from lmcompress.methods.common import prune_layer_
from lmcompress.methods.obs import HessianStatistic, output_error
from lmcompress.methods.pruning import LayerwisePruningMethod
from lmcompress.methods.sparsegpt.config import SparseGPTConfig
from lmcompress.methods.sparsegpt.solver import sparsegpt_prune

__all__ = ["SparseGPT", "output_error"]


class SparseGPT(HessianStatistic, LayerwisePruningMethod):
    config_class = SparseGPTConfig

    def pruning_group(self, shape: tuple[int, int]) -> int:
        return shape[0] * min(self.config.blocksize, shape[1])  # within each block of columns

    def prune(
        self, name: str, module: nn.Module, statistic: torch.Tensor, sparsity: Sparsity
    ) -> LayerReport:
        start = time.perf_counter()
        W = weight_matrix(module).detach()
        H = statistic  # (in, in)
        W_new, keep = sparsegpt_prune(
            W,
            H,
            sparsity,
            blocksize=self.config.blocksize,
            percdamp=self.config.percdamp,
            update_weights=self.config.update_weights,
        )
        error = output_error(W, W_new, H)
        report = prune_layer_(name, module, keep, sparsity, start, new_weight=W_new)
        report.rel_error, report.error_kind = error, "output"
        return report
