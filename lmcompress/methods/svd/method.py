"""Plain truncated SVD (the low-rank baseline): no calibration, every selected linear becomes a
:class:`LowRankLinear` at the rank its parameter budget allows (``ranks.budget_rank``).

Plain SVD minimises the weight error ``‖W - BA‖_F``, not the error of the layer's output on
real inputs; on LLM weights (flat singular spectra) that costs a lot of perplexity, which is
what the Fisher-weighted variants are for.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn
from tqdm.auto import tqdm

from lmcompress.compressor.formats.low_rank import LowRankLinear
from lmcompress.compressor.method import Method, Stats
from lmcompress.compressor.report import CompressionReport, LayerReport
from lmcompress.compressor.surgery import replace_modules, weight_matrix
from lmcompress.methods.common import count_params
from lmcompress.methods.svd.config import SVDConfig
from lmcompress.methods.svd.ranks import budget_rank

logger = logging.getLogger(__name__)


class SVD(Method):
    config_class = SVDConfig
    needs_calibration = False

    def apply(self, model: nn.Module, stats: Stats) -> CompressionReport:  # noqa: ARG002
        start = time.perf_counter()
        layers = self.validate(model)
        report = CompressionReport(
            self.name, self.config.to_dict(), model_params=count_params(model)
        )
        with tqdm(total=len(layers), desc="svd", unit="layer") as bar:

            def factorize(name: str, module: nn.Module) -> LowRankLinear | None:
                layer_start = time.perf_counter()
                out_features, in_features = weight_matrix(module).shape
                rank = budget_rank(out_features, in_features, self.config.ratio)
                new = None if rank is None else LowRankLinear.from_linear(module, rank)
                if new is None:
                    logger.info(
                        "%s (%dx%d) stays dense: at ratio %g a factorisation would not save "
                        "parameters",
                        name,
                        out_features,
                        in_features,
                        self.config.ratio,
                    )
                report.layers.append(layer_report(name, module, new, layer_start))
                bar.update(1)
                return new

            replace_modules(model, layers, factorize)
        report.seconds = time.perf_counter() - start
        report.extra = {
            "ratio": self.config.ratio,
            "params_kept_fraction": report.params_kept / max(report.params, 1),
            "dense_layers": [layer.name for layer in report.layers if layer.rank is None],
        }
        logger.info(
            "svd: kept %d of %d parameters (%.2f%%, ratio %g); %d of %d layers stay dense",
            report.params_kept,
            report.params,
            100 * report.extra["params_kept_fraction"],
            self.config.ratio,
            len(report.extra["dense_layers"]),
            len(report.layers),
        )
        return report


@torch.no_grad()
def layer_report(
    name: str, dense: nn.Module, new: LowRankLinear | None, started: float
) -> LayerReport:
    """What factorising ``dense`` into ``new`` did (``new is None``: the layer stayed dense)."""
    W = weight_matrix(dense)  # (out, in)
    numel, elem = W.numel(), W.element_size()
    if new is None:
        kept, rel_error, rank = numel, 0.0, None
    else:
        rank = new.rank
        kept = rank * (new.out_features + new.in_features)
        W32 = W.float()
        rel_error = float((W32 - new.dense_weight().float()).norm() / W32.norm().clamp_min(1e-30))
    return LayerReport(
        name=name,
        shape=tuple(W.shape),
        params=numel,
        params_kept=kept,
        bytes_dense=numel * elem,
        bytes_compressed=kept * elem,
        rank=rank,
        rel_error=rel_error,
        seconds=time.perf_counter() - started,
        format=None if new is None else LowRankLinear.format,
        format_options={} if new is None else {"rank": rank},
    )
