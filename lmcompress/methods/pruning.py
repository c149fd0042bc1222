"""What the pruning methods (magnitude, Wanda, SparseGPT) share: the config with the target
sparsity and per-layer overrides, and the base class of calibrated (layer-wise) pruners."""

from __future__ import annotations

import fnmatch
import time
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from lmcompress.compressor.config import MethodConfig, Sparsity, parse_sparsity
from lmcompress.compressor.layerwise import Accumulator, compress_layerwise
from lmcompress.compressor.method import Method, Stats
from lmcompress.compressor.report import CompressionReport, LayerReport
from lmcompress.compressor.sparsity import check_nm_shape
from lmcompress.compressor.surgery import weight_matrix
from lmcompress.errors import ConfigError
from lmcompress.methods.common import count_params


@dataclass(frozen=True)
class PruningConfig(MethodConfig):
    """A target sparsity for every selected layer, optionally overridden per layer."""

    sparsity: str = field(
        default="2:4",
        metadata={"help": "N:M pattern (keep N of every M input weights) or fraction removed"},
    )
    layer_sparsity: tuple[str, ...] = field(
        default=(),
        metadata={"help": "per-layer overrides GLOB=SPARSITY (first match wins)"},
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "sparsity", str(parse_sparsity(self.sparsity)))
        for entry in self.layer_sparsity:
            pattern, sep, value = entry.rpartition("=")
            if not sep or not pattern:
                raise ConfigError(f"layer_sparsity entry {entry!r} is not GLOB=SPARSITY")
            parse_sparsity(value)

    @property
    def pattern(self) -> Sparsity:
        return parse_sparsity(self.sparsity)

    def sparsity_of(self, layer_name: str) -> Sparsity:
        for entry in self.layer_sparsity:
            pattern, _, value = entry.rpartition("=")
            if fnmatch.fnmatchcase(layer_name, pattern):
                return parse_sparsity(value)
        return self.pattern


@dataclass(frozen=True)
class CalibratedPruningConfig(PruningConfig):
    """Pruning that reads each layer's inputs, block by block."""

    method: ClassVar[str] = ""

    calib_batch_size: int = field(default=8, metadata={"help": "calibration windows per pass"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.calib_batch_size < 1:
            raise ConfigError(f"calib_batch_size must be at least 1, got {self.calib_batch_size}")


class PruningMethod(Method):
    """Validation shared by every pruner: shapes fit each layer's N:M pattern."""

    def validate(self, model: nn.Module) -> dict[str, nn.Module]:
        layers = super().validate(model)
        for name, module in layers.items():
            sparsity = self.config.sparsity_of(name)
            if sparsity.is_nm:
                check_nm_shape(tuple(weight_matrix(module).shape), sparsity.m, name)
        return layers


class LayerwisePruningMethod(PruningMethod):
    """A pruner that needs each layer's calibration inputs (Wanda, SparseGPT).

    Each block must be pruned before the next block's inputs can be computed (the next block
    sees the pruned outputs), so the work happens in :meth:`calibrate`, inside the core's
    layer-wise loop; :meth:`apply` assembles the report. Subclasses implement
    :meth:`make_accumulator` and :meth:`prune_layer`.
    """

    def make_accumulator(self, name: str, module: nn.Module) -> Accumulator:
        raise NotImplementedError

    def prune_layer(
        self, name: str, module: nn.Module, stats: Accumulator, sparsity: Sparsity
    ) -> LayerReport:
        raise NotImplementedError

    def calibrate(self, model: nn.Module, data: torch.Tensor | None) -> Stats:
        if data is None:
            raise ConfigError(f"method {self.name!r} needs calibration data")
        start = time.perf_counter()
        layers = self.validate(model)
        reports, loop = compress_layerwise(
            model,
            data,
            layers,
            make_accumulator=self.make_accumulator,
            compress_layer=lambda n, m, acc: self.prune_layer(
                n, m, acc, self.config.sparsity_of(n)
            ),
            device=self.device or next(model.parameters()).device,
            batch_size=self.config.calib_batch_size,
        )
        return Stats(
            meta={
                "layers": reports,
                "seconds": time.perf_counter() - start,
                "peak_state_bytes": loop.peak_state_bytes,
                "nsamples": int(data.shape[0]),
                "seq_len": int(data.shape[1]),
            }
        )

    def apply(self, model: nn.Module, stats: Stats) -> CompressionReport:
        return CompressionReport(
            self.name,
            self.config.to_dict(),
            layers=list(stats.meta["layers"]),
            seconds=stats.meta["seconds"],
            model_params=count_params(model),
            extra={k: stats.meta[k] for k in ("peak_state_bytes", "nsamples", "seq_len")},
        )
