"""Wanda through the layer-wise loop: input norms per layer, then masks; no weight update."""

from __future__ import annotations

import time

import torch
from torch import nn

from lmcompress.compressor.config import Sparsity
from lmcompress.compressor.model.surgery import weight_matrix
from lmcompress.compressor.report import LayerReport
from lmcompress.methods.common import prune_layer_
from lmcompress.methods.pruning import LayerwisePruningMethod
from lmcompress.methods.wanda.config import WandaConfig
from lmcompress.methods.wanda.scores import InputNorms, wanda_mask


class Wanda(LayerwisePruningMethod):
    config_class = WandaConfig
    statistic = "input_norms"  # ‖X_j‖₂ of each input feature over the calibration tokens, (in,)

    def make_accumulator(self, name: str, module: nn.Module) -> InputNorms:  # noqa: ARG002
        W = weight_matrix(module)
        return InputNorms(W.shape[1], device=W.device)

    def statistic_of(self, accumulator: InputNorms) -> torch.Tensor:
        return accumulator.norms

    def pruning_group(self, shape: tuple[int, int]) -> int:
        return shape[1]  # the ratio is counted within each output row (wanda_mask)

    def accumulator_bytes(self, module: nn.Module) -> int:
        return 8 * weight_matrix(module).shape[1]  # a float64 sum of squares per input

    def prune(
        self, name: str, module: nn.Module, statistic: torch.Tensor, sparsity: Sparsity
    ) -> LayerReport:
        start = time.perf_counter()
        keep = wanda_mask(weight_matrix(module).detach(), statistic, sparsity)
        return prune_layer_(name, module, keep, sparsity, start)
