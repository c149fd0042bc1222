"""The low-rank methods: every selected linear becomes a :class:`LowRankLinear` whose factors
minimise a weighted error of the weight (:mod:`weighted`), at ranks from the parameter budget
(:mod:`ranks`). The methods differ only in their statistics and the weights built from them:

- ``svd``: none (the baseline: minimises ‖W − BA‖_F, which on LLM weights, whose singular
  spectra are flat, costs a lot of perplexity);
- ``asvd``: mean |x| per input channel, from forward passes over calibration text;
- ``svd-llm``: Σ x xᵀ per layer, from the same forward passes;
- ``fwsvd``: the diagonal empirical Fisher Σ G², from the core's gradient pass;
- ``gfwsvd``: Kronecker factors of the Fisher, from the same pass (K-FAC) or from its
  per-sample gradients (the nearest Kronecker product, :mod:`kronecker`).

All statistics come from the dense model in one pass, before any layer changes (as the
reference implementations do), so ranks can be allocated across all layers at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers.pytorch_utils import Conv1D

from lmcompress.compressor.calibration.layerwise import BlockSource, layerwise_estimate
from lmcompress.compressor.formats.low_rank import LowRankLinear
from lmcompress.compressor.method import Method, Stats
from lmcompress.compressor.model.budget import backward_bytes
from lmcompress.compressor.model.surgery import replace_modules, weight_matrix
from lmcompress.compressor.report import CompressionReport, LayerReport
from lmcompress.compressor.util.progress import bar_disabled
from lmcompress.errors import ConfigError
from lmcompress.methods.common import count_params
from lmcompress.methods.svd.config import LowRankConfig, SVDConfig
from lmcompress.methods.svd.ranks import (
    RANK_MULTIPLE,
    allocate_ranks,
    budget_rank,
    smallest_greedy_ratio,
    smallest_ratio,
)
from lmcompress.methods.svd.sequential import compress_sequential
from lmcompress.methods.svd.weighted import (
    Weight,
    weighted_error,
    weighted_factors,
    weighted_spectrum,
)

logger = logging.getLogger(__name__)

Weights = tuple[Weight, Weight, dict[str, Any]]  # input side, output side, what to report


class LowRankMethod(Method):
    """Base of the family: ``weights`` turns a layer's statistics into the weighted norm;
    ``apply`` allocates ranks and factorises. Subclasses set ``config_class`` and override
    ``calibrate`` and ``weights``."""

    config_class = LowRankConfig
    needs_calibration = False
    stats_in_output = False  # Gram matrices and Kronecker factors: as large as the model

    def stored_format(self, layer: str) -> str:  # noqa: ARG002
        return LowRankLinear.format

    def weights(self, name: str, W: torch.Tensor, stats: Stats) -> Weights:  # noqa: ARG002
        """The input-side and output-side weights of layer ``name`` (``None``: identity)."""
        return None, None, {}

    def input_gram(self) -> str | None:
        """The key of the statistic that is the inputs' Gram Σ x xᵀ (up to scale), which
        ``--sequential`` re-collects on the compressed model; ``None``: the method has none."""
        return None

    def block_by_block(self) -> bool:
        """``sequential``, ``refit``, ``tune_steps`` or ``distill_steps``: factorise inside the
        layer-wise loop (the calibrated methods' options; plain SVD has none)."""
        config = self.config
        return (
            getattr(config, "sequential", False)
            or getattr(config, "refit", "none") != "none"
            or getattr(config, "tune_steps", 0) > 0
            or getattr(config, "distill_steps", 0) > 0
        )

    def block_pass_estimate(
        self, model: nn.Module, nsamples: int, seq_len: int, itemsize: int = 4
    ) -> dict[str, int]:
        """Bytes of the block-by-block pass of ``sequential`` / ``refit`` / ``tune_steps`` /
        ``distill_steps`` (none without them): the layer-wise loop's hidden states and each
        layer's float32 input Gram; tuning adds the dense stream's block outputs and, per
        layer, its float32 factors with their gradients and AdamW moments (at most 16 bytes a
        weight: rank < full); distillation the dense weights, every layer's factor state and
        one window's activations for backward."""
        if not self.block_by_block():
            return {}
        config = self.config
        layers = self.validate(model)
        tune = getattr(config, "tune_steps", 0) > 0

        def state(module: nn.Module) -> int:
            rows, cols = weight_matrix(module).shape
            return 4 * cols**2 + (16 * rows * cols if tune else 0)

        parts = layerwise_estimate(
            model, layers, nsamples, seq_len, config.calib_batch_size, itemsize,
            state={"input Gram": state},
        )  # fmt: skip
        if tune:
            parts["dense block outputs"] = parts["calibration activations"]
        if getattr(config, "distill_steps", 0) > 0:  # the teacher's weights, the factors'
            numel = sum(weight_matrix(m).numel() for m in layers.values())  # state, backward
            parts["dense weights and factor state"] = itemsize * numel + 16 * numel
            parts["activations kept for backward"] = backward_bytes(model, 1, seq_len, itemsize, 3)
        return {"block-by-block pass": sum(parts.values())}

    def compress(
        self,
        model: nn.Module,
        data: torch.Tensor | None = None,
        source: BlockSource | None = None,
        offload_dir: str | Path | None = None,
    ) -> tuple[CompressionReport, Stats]:
        """The dense statistics (on the first ``stats_nsamples`` windows), then the
        factorisation: all at once (``apply``), or block by block on the compressed inputs
        with ``sequential`` / ``refit`` / ``tune_steps`` / ``distill_steps``
        (``sequential``), which take every window."""
        if not self.block_by_block():
            return super().compress(model, self.stats_data(data), source, offload_dir)
        if source is not None:
            raise ConfigError(
                f"{self.name} --sequential / --refit / --tune-steps / --distill-steps cannot stream"
            )
        if data is None:
            raise ConfigError(f"method {self.name!r} needs calibration data")
        model.eval()
        stats = self.calibrate(model, self.stats_data(data))
        return compress_sequential(self, model, data, stats), stats

    def stats_windows(self, nsamples: int) -> int:
        """How many of ``nsamples`` calibration windows the statistics see: the first
        ``stats_nsamples`` (0, or a method without the option: all). More than there are is
        a :class:`ConfigError`, raised before any pass starts."""
        wanted = getattr(self.config, "stats_nsamples", 0)
        if wanted > nsamples:
            raise ConfigError(
                f"{self.name}: --stats-nsamples {wanted} exceeds the {nsamples} calibration "
                "windows (--nsamples); it takes the first N of them"
            )
        return wanted or nsamples

    def stats_data(self, data: torch.Tensor | None) -> torch.Tensor | None:
        """The windows the statistics are collected on: the first :meth:`stats_windows`."""
        if data is None:
            return None
        return data[: self.stats_windows(int(data.shape[0]))]

    def validate(self, model: nn.Module) -> dict[str, nn.Module]:
        """The selected layers; a :class:`ConfigError` naming the smallest ratio that works
        when ``ratio`` (below 1, which keeps every layer dense on purpose) would compress
        nothing: every rank rounds down to 0 (uniform), or the budget is below rank
        :data:`RANK_MULTIPLE` everywhere (greedy, which would keep more than asked). Shapes
        only, so it runs on the skeleton before any weight is read."""
        layers = super().validate(model)
        if getattr(self.config, "sequential", False) and self.input_gram() is None:
            raise ConfigError(
                f"{self.name}: --sequential re-collects the inputs' Gram matrix, which only "
                "svd-llm and gfwsvd (--kronecker kfac) weight by"
            )
        ratio = self.config.ratio
        if ratio >= 1.0 or not layers:
            return layers
        names = list(layers)
        shapes = [tuple(weight_matrix(module).shape) for module in layers.values()]
        smallest = smallest_ratio(shapes)
        if smallest is None:
            raise ConfigError(
                f"{self.name}: no selected layer is large enough for rank-{RANK_MULTIPLE} "
                "factors to be smaller than its weight; select larger layers (include/exclude)"
            )
        least, index = smallest
        if self.config.allocation == "uniform" and ratio < least:
            raise ConfigError(
                f"--ratio {ratio:g} leaves every selected layer dense (each rank rounds down "
                f"to 0, ranks being multiples of {RANK_MULTIPLE}); the smallest ratio that "
                f"compresses is {least:g} ({names[index]}, {shapes[index][0]}x{shapes[index][1]})"
            )
        floor = smallest_greedy_ratio(shapes)
        if self.config.allocation == "greedy" and ratio < floor:
            raise ConfigError(
                f"--ratio {ratio:g} is below what rank {RANK_MULTIPLE} in every selected layer "
                f"keeps (greedy allocation starts there); the smallest ratio is {floor:g}"
            )
        return layers

    def ranks(self, layers: dict[str, nn.Module], stats: Stats) -> dict[str, int | None]:
        """Every layer's rank (``None``: stays dense). Greedy allocation needs every layer's
        weighted spectrum first; the weights are rebuilt when factorising rather than all kept
        (GFWSVD's Cholesky factors would double the memory of its statistics)."""
        config = self.config
        shapes = {name: tuple(weight_matrix(module).shape) for name, module in layers.items()}
        if config.allocation == "uniform":
            return {name: budget_rank(m, n, config.ratio) for name, (m, n) in shapes.items()}
        spectra = {}
        for name, module in tqdm(
            layers.items(), desc=f"{self.name} spectra", unit="layer", disable=bar_disabled()
        ):
            W = weight_matrix(module).detach()
            right, left, _ = self.weights(name, W, stats)
            spectra[name] = (*shapes[name], weighted_spectrum(W, right, left).cpu())
        return allocate_ranks(spectra, config.ratio, relative=not config.absolute_errors)

    def apply(self, model: nn.Module, stats: Stats) -> CompressionReport:
        start = time.perf_counter()
        layers = self.validate(model)
        report = CompressionReport(
            self.name, self.config.to_dict(), model_params=count_params(model)
        )
        ranks = self.ranks(layers, stats)
        with tqdm(total=len(layers), desc=self.name, unit="layer", disable=bar_disabled()) as bar:

            def factorize(name: str, module: nn.Module) -> LowRankLinear | None:
                new, layer = self.factorize(name, module, ranks[name], stats)
                report.layers.append(layer)
                bar.update(1)
                return new

            replace_modules(model, layers, factorize)
        return self.finish_report(report, start)

    def factorize(
        self,
        name: str,
        module: nn.Module,
        rank: int | None,
        stats: Stats,
        refit: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> tuple[LowRankLinear | None, LayerReport]:
        """``module``'s factor pair at ``rank`` (``None``: it stays dense) and its report;
        ``refit(W, A, B)`` returns a new output factor B (``sequential.output_refit``)."""
        layer_start = time.perf_counter()
        W = weight_matrix(module).detach()
        right, left, info = self.weights(name, W, stats)
        new = None
        if rank is not None:
            A, B = weighted_factors(W, rank, right, left)
            if refit is not None:
                B = refit(W, A, B)
            bias = module.bias.detach().clone() if module.bias is not None else None
            new = LowRankLinear.from_factors(A, B, bias, isinstance(module, Conv1D))
        else:
            logger.info("%s (%dx%d) stays dense", name, *W.shape)
        layer = layer_report(name, module, new, layer_start)
        if new is not None and (right is not None or left is not None):
            total = weighted_error(W, torch.zeros_like(W), right, left)
            error = weighted_error(W, new.dense_weight(), right, left)
            info = {**info, "weighted_rel_error": (error / max(total, 1e-300)) ** 0.5}
        layer.extra = info
        return new, layer

    def finish_report(self, report: CompressionReport, start: float) -> CompressionReport:
        """Set the report's time and totals once every layer is in, and log them."""
        report.seconds = time.perf_counter() - start
        report.extra = {
            "ratio": self.config.ratio,
            "allocation": self.config.allocation,
            "params_kept_fraction": report.params_kept / max(report.params, 1),
            "dense_layers": [layer.name for layer in report.layers if layer.rank is None],
            "ranks": {layer.name: layer.rank for layer in report.layers},
        }
        logger.info(
            "%s: kept %d of %d parameters (%.2f%%, ratio %g, %s ranks); %d of %d layers stay dense",
            self.name,
            report.params_kept,
            report.params,
            100 * report.extra["params_kept_fraction"],
            self.config.ratio,
            self.config.allocation,
            len(report.extra["dense_layers"]),
            len(report.layers),
        )
        return report


class SVD(LowRankMethod):
    config_class = SVDConfig


def stat(stats: Stats, name: str, key: str) -> torch.Tensor:
    """``stats.tensors["{name}.{key}"]``, or a one-line error naming what is missing."""
    try:
        return stats.tensors[f"{name}.{key}"]
    except KeyError:
        raise ConfigError(
            f"no {key} statistics for layer {name!r}: these stats were not collected by this "
            "method on this model"
        ) from None


@torch.no_grad()
def layer_report(
    name: str, dense: nn.Module, new: LowRankLinear | None, started: float
) -> LayerReport:
    """What factorising ``dense`` into ``new`` did (``new is None``: the layer stayed dense).
    ``rel_error``: the plain relative weight error ‖W − BA‖ / ‖W‖."""
    W = weight_matrix(dense)  # (out, in)
    elem = W.element_size()
    if new is None:
        return LayerReport.measure(
            name, W, None, started, params_kept=W.numel(), bytes_compressed=W.numel() * elem
        )
    rank = new.rank
    kept = rank * (new.out_features + new.in_features)
    return LayerReport.measure(
        name,
        W,
        new.dense_weight(),
        started,
        params_kept=kept,
        bytes_compressed=kept * elem,
        rank=rank,
        format=LowRankLinear.format,
        format_options={"rank": rank},
    )
