"""What the pruning methods (magnitude, Wanda, SparseGPT) share: the config with the target
sparsity and per-layer overrides, and the base class of calibrated (layer-wise) pruners."""

from __future__ import annotations

import fnmatch
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from lmcompress.compressor.calibration.layerwise import (
    Accumulator,
    BlockSource,
    compress_layerwise,
    layerwise_estimate,
)
from lmcompress.compressor.config import MethodConfig, Sparsity, parse_sparsity
from lmcompress.compressor.method import Method, Stats
from lmcompress.compressor.model.surgery import is_linear, weight_matrix
from lmcompress.compressor.report import CompressionReport, LayerReport
from lmcompress.compressor.sparsity import check_nm_shape
from lmcompress.errors import ConfigError, shown
from lmcompress.methods.common import count_params

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PruningConfig(MethodConfig):
    """A target sparsity for every selected layer, optionally overridden per layer.

    ``sparsity`` is stored parsed (a :class:`Sparsity`; ``"2:4"``, ``"0.5"`` or ``0.5`` are
    accepted), and each ``layer_sparsity`` entry ``GLOB=SPARSITY`` is parsed once into
    :attr:`layer_rules`; recipes keep the text forms.
    """

    sparsity: Sparsity = field(
        default=Sparsity(n=2, m=4),
        metadata={
            "help": "fraction of weights removed (0.5) or an N:M pattern, keep N of every M "
            "input weights (2:4); compare --ratio of the low-rank methods, the fraction kept"
        },
    )
    layer_sparsity: tuple[str, ...] = field(
        default=(),
        metadata={"help": "per-layer overrides GLOB=SPARSITY (first match wins)"},
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        rules = tuple(_parse_rule(entry) for entry in self.layer_sparsity)
        object.__setattr__(self, "layer_sparsity", tuple(f"{g}={s}" for g, s in rules))
        object.__setattr__(self, "_layer_rules", rules)  # derived: not a field, not compared

    @property
    def layer_rules(self) -> tuple[tuple[str, Sparsity], ...]:
        """The parsed ``layer_sparsity``: ``(glob, Sparsity)`` pairs, first match wins."""
        return self._layer_rules

    @property
    def pattern(self) -> Sparsity:
        """The default target (an alias of ``sparsity``, kept for callers)."""
        return self.sparsity

    def sparsity_of(self, layer_name: str) -> Sparsity:
        for pattern, sparsity in self._layer_rules:
            if fnmatch.fnmatchcase(layer_name, pattern):
                return sparsity
        return self.sparsity


def _parse_rule(entry: str) -> tuple[str, Sparsity]:
    pattern, sep, value = str(entry).rpartition("=")
    if not sep or not pattern:
        raise ConfigError(f"layer_sparsity entry {shown(entry)} is not GLOB=SPARSITY")
    return pattern, parse_sparsity(value)


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
    """Validation shared by every pruner: shapes fit each layer's N:M pattern; a per-layer
    override that matches no selected layer (a typo, most likely) is warned about."""

    def stored_format(self, layer: str) -> str | None:
        """N:M-pruned layers are stored packed; unstructured zeros stay in the dense weight."""
        return "nm_packed" if self.config.sparsity_of(layer).is_nm else None

    def pruning_group(self, shape: tuple[int, int]) -> int:
        """The weights of an ``(out, in)`` layer among which an unstructured ratio is counted
        (rounded down): the whole layer. A method that ranks within smaller groups says so."""
        return shape[0] * shape[1]

    def validate(self, model: nn.Module) -> dict[str, nn.Module]:
        layers = super().validate(model)
        removes = not layers  # whether the sparsity removes a weight of some layer
        largest, least = 0, None
        for name, module in layers.items():
            sparsity = self.config.sparsity_of(name)
            shape = tuple(weight_matrix(module).shape)
            if sparsity.is_nm:
                check_nm_shape(shape, sparsity.m, name)
                removes = True
                continue
            group = self.pruning_group(shape)
            removes = removes or int(group * sparsity.ratio) > 0
            largest, least = max(largest, group), least or sparsity
        if not removes:
            raise ConfigError(
                f"--sparsity {least} removes no weight of any selected layer (the count of "
                f"each group of weights rounds down to 0); {self.name} needs at least "
                f"1/{largest} = {1 / largest:.3g}"
            )
        for pattern, sparsity in self.config.layer_rules:
            if not any(fnmatch.fnmatchcase(name, pattern) for name in layers):
                raise ConfigError(
                    f"--layer-sparsity {pattern}={sparsity} matches none of the {len(layers)} "
                    f"selected layers (e.g. {next(iter(layers), 'none')})"
                )
        return layers


class LayerwisePruningMethod(PruningMethod):
    """A pruner that needs each layer's calibration inputs (Wanda, SparseGPT).

    The computation is :meth:`prune`: one layer from its statistic (Wanda's input norms,
    SparseGPT's Hessian), a pure function of the weight and the statistic. :meth:`apply` runs it
    on the statistics a :class:`Stats` holds (``"<layer>.<statistic>"``, e.g. synthetic ones in
    a test). Calibrating a model cannot hand all statistics to :meth:`apply` at once: each block
    must be pruned before the next block's inputs exist (the next block sees the pruned
    outputs), so :meth:`calibrate` runs the core's layer-wise loop and calls :meth:`prune` on
    each block as its statistics complete. Its stats then describe the layers it pruned
    (``meta["layers"]``: a Hessian per layer would be as large as the model), and :meth:`apply`
    reports them. Subclasses implement :meth:`make_accumulator`, :meth:`statistic_of` and
    :meth:`prune`, and name their ``statistic``.
    """

    statistic: ClassVar[str] = ""  # key suffix of a layer's statistic in Stats.tensors
    streams = True

    def make_accumulator(self, name: str, module: nn.Module) -> Accumulator:
        raise NotImplementedError

    def statistic_of(self, accumulator: Accumulator) -> torch.Tensor:
        """The statistic an accumulator collected (what :meth:`prune` takes)."""
        raise NotImplementedError

    def accumulator_bytes(self, module: nn.Module) -> int:  # noqa: ARG002
        """Bytes of one layer's accumulator (the Hessian for SparseGPT), for the estimate."""
        return 0

    def prune(
        self, name: str, module: nn.Module, statistic: torch.Tensor, sparsity: Sparsity
    ) -> LayerReport:
        """Prune ``module`` in place from its ``statistic``; report it."""
        raise NotImplementedError

    def memory_estimate(
        self, model: nn.Module, nsamples: int, seq_len: int, itemsize: int = 4
    ) -> dict[str, int]:
        """Every window's block inputs are held through the layer-wise loop, plus one block's
        accumulators and one batch's transient activations."""
        return layerwise_estimate(
            model,
            self.validate(model),
            nsamples,
            seq_len,
            self.config.calib_batch_size,
            itemsize,
            state={"per-layer statistics": self.accumulator_bytes},
        )

    def calibrate(
        self,
        model: nn.Module,
        data: torch.Tensor | None,
        source: BlockSource | None = None,
        offload_dir: str | Path | None = None,
    ) -> Stats:
        """``source`` / ``offload_dir``: see :func:`compress_layerwise` (``--streaming``)."""
        if data is None:
            raise ConfigError(f"method {self.name!r} needs calibration data")
        start = time.perf_counter()
        layers = self.validate(model)
        home = next((p.device for p in model.parameters() if not p.is_meta), torch.device("cpu"))
        reports, loop = compress_layerwise(
            model,
            data,
            layers,
            make_accumulator=self.make_accumulator,
            compress_layer=lambda n, m, acc: self.prune(
                n, m, self.statistic_of(acc), self.config.sparsity_of(n)
            ),
            device=self.device or home,
            batch_size=self.config.calib_batch_size,
            source=source,
            offload_dir=offload_dir,
        )
        return Stats(
            meta={
                "layers": [asdict(report) for report in reports],  # JSON, so Stats.save works
                "seconds": time.perf_counter() - start,
                "peak_state_bytes": loop.peak_state_bytes,
                "nsamples": int(data.shape[0]),
                "seq_len": int(data.shape[1]),
            }
        )

    def compress_streaming(
        self,
        model: nn.Module,
        data: torch.Tensor | None,
        source: BlockSource,
        offload_dir: str | Path | None = None,
    ) -> CompressionReport:
        """Compress a meta-device skeleton whose blocks ``source`` materialises and writes."""
        return self._report(model, self.calibrate(model, data, source, offload_dir))

    def apply(self, model: nn.Module, stats: Stats) -> CompressionReport:
        """Prune every layer whose statistic ``stats`` holds, and report, with them, the layers
        :meth:`calibrate` pruned already (``meta["layers"]``; the stats hold no weights, so
        ``model`` must be the model that was calibrated: a layer with more nonzero weights than
        the stats say were kept is refused rather than reported as pruned)."""
        start = time.perf_counter()
        done = [LayerReport.from_dict(x) for x in stats.meta.get("layers", [])]
        _check_pruned(model, done, self.name)
        suffix = f".{self.statistic}"
        given = {k.removesuffix(suffix): v for k, v in stats.tensors.items() if k.endswith(suffix)}
        for name, statistic in given.items():
            try:
                module = model.get_submodule(name)
            except AttributeError:
                what = f"{self.name} stats name {name}, which this model lacks"
                raise ConfigError(what) from None
            done.append(self.prune(name, module, statistic, self.config.sparsity_of(name)))
        meta = {**stats.meta, "layers": [asdict(layer) for layer in done]}
        meta.setdefault("seconds", time.perf_counter() - start)
        return self._report(model, Stats(meta=meta))

    def _report(self, model: nn.Module, stats: Stats) -> CompressionReport:
        layers = [LayerReport.from_dict(layer) for layer in stats.meta["layers"]]
        return CompressionReport(
            self.name,
            self.config.to_dict(),
            layers=layers,
            seconds=stats.meta["seconds"],
            model_params=count_params(model),
            extra={
                k: stats.meta[k]
                for k in ("peak_state_bytes", "nsamples", "seq_len")
                if k in stats.meta
            },
        )


@torch.no_grad()
def _check_pruned(model: nn.Module, layers: list[LayerReport], method: str) -> None:
    for layer in layers:
        try:
            module = model.get_submodule(layer.name)
        except AttributeError:
            raise ConfigError(f"{method} stats name {layer.name}, which this model lacks") from None
        if not is_linear(module):
            continue
        nonzero = int(torch.count_nonzero(weight_matrix(module)))
        if nonzero > layer.params_kept:
            raise ConfigError(
                f"{method} prunes during calibrate(); its stats describe that model, but "
                f"{layer.name} here has {nonzero} nonzero weights > {layer.params_kept} kept: "
                "apply the stats to the calibrated model"
            )
