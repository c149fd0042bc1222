"""The bases of the methods that compress one layer at a time: from a statistic of its
calibration inputs, through the core's layer-wise loop (:class:`LayerwiseMethod`), or from its
weight alone (:class:`OneShotMethod`); ``--streaming`` included in both."""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn
from tqdm.auto import tqdm

from lmcompress.compressor.calibration.layerwise import (
    Accumulator,
    BlockSource,
    compress_layerwise,
    layerwise_estimate,
    stream_blocks,
)
from lmcompress.compressor.method import Method, Stats
from lmcompress.compressor.model.families import family_of
from lmcompress.compressor.model.surgery import is_linear, weight_matrix
from lmcompress.compressor.report import CompressionReport, LayerReport
from lmcompress.compressor.util.progress import bar_disabled
from lmcompress.errors import ConfigError
from lmcompress.methods.common import count_params


class OneShotMethod:
    """A method that compresses each selected layer from its weight alone (magnitude, RTN), a
    mixin before its :class:`Method` base: :meth:`apply` runs :meth:`compress_layer` on every
    layer ``validate`` selects; :meth:`compress_streaming` on each block's as the block is
    materialised (layers outside the decoder blocks cannot be streamed: the skeleton never
    holds them)."""

    def compress_layer(self, model: nn.Module, name: str, module: nn.Module) -> LayerReport:
        raise NotImplementedError

    def apply(self, model: nn.Module, stats: Stats) -> CompressionReport:  # noqa: ARG002
        start = time.perf_counter()
        layers = self.validate(model)
        report = CompressionReport(
            self.name, self.config.to_dict(), model_params=count_params(model)
        )
        bars = {"desc": self.name, "unit": "layer", "disable": bar_disabled()}
        for name, module in tqdm(layers.items(), **bars):
            report.layers.append(self.compress_layer(model, name, module))
        report.seconds = time.perf_counter() - start
        return report

    def compress_streaming(
        self,
        model: nn.Module,
        data: torch.Tensor | None,  # noqa: ARG002
        source: BlockSource,
        offload_dir: str | Path | None = None,  # noqa: ARG002
    ) -> CompressionReport:
        """:meth:`apply` on a meta-device skeleton, one block materialised at a time."""
        start = time.perf_counter()
        layers = self.validate(model)
        prefix = family_of(model).blocks
        if outside := [name for name in layers if not name.startswith(prefix + ".")]:
            raise ConfigError(f"--streaming compresses decoder blocks only, not {outside}")

        def compress_block(index: int, _block: nn.Module) -> list[LayerReport]:
            inside = f"{prefix}.{index}."
            return [
                self.compress_layer(model, n, m) for n, m in layers.items() if n.startswith(inside)
            ]

        report = CompressionReport(
            self.name, self.config.to_dict(), model_params=count_params(model)
        )
        report.layers = stream_blocks(model, source, compress_block)
        report.seconds = time.perf_counter() - start
        return report


class LayerwiseMethod(Method):
    """A method that compresses each layer from a statistic of its calibration inputs
    (Wanda, SparseGPT, GPTQ).

    The computation is :meth:`compress_layer`: one layer from its statistic (Wanda's input
    norms, the Hessian), in place (a changed weight, or the layer replaced by a compressed
    module). :meth:`apply` runs it on the statistics a :class:`Stats` holds
    (``"<layer>.<statistic>"``, e.g. synthetic ones in a test). Calibrating a model cannot hand
    all statistics to :meth:`apply` at once: each block must be compressed before the next
    block's inputs exist (the next block sees the compressed outputs), so :meth:`calibrate`
    runs the core's layer-wise loop and calls :meth:`compress_layer` on each block as its
    statistics complete. Its stats then describe the layers it compressed (``meta["layers"]``:
    a Hessian per layer would be as large as the model), and :meth:`apply` reports them.
    Subclasses implement :meth:`make_accumulator`, :meth:`statistic_of` and
    :meth:`compress_layer`, and name their ``statistic``.
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

    def compress_layer(
        self, model: nn.Module, name: str, module: nn.Module, statistic: torch.Tensor
    ) -> LayerReport:
        """Compress layer ``name`` of ``model`` (``module``) from its ``statistic``, in place (a
        new weight, or a compressed module put in its place); report it."""
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
            compress_layer=lambda n, m, acc: self.compress_layer(
                model, n, m, self.statistic_of(acc)
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
            done.append(self.compress_layer(model, name, module, statistic))
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
