"""The method protocol: ``calibrate(model, data) -> Stats`` then ``apply(model, stats) -> report``.

Stats are plain tensors keyed by name, saveable with safetensors, so ``apply`` can be tested on
synthetic stats and a run can resume after calibration. What a method can do is declared on its
class (:class:`Method`'s capabilities), and the job reads those, never a method's name.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from safetensors.torch import save_file
from torch import nn

from lmcompress.compressor.calibration.layerwise import BlockSource
from lmcompress.compressor.config import MethodConfig
from lmcompress.compressor.io.shards import read_safetensors
from lmcompress.compressor.model.surgery import LayerSelection
from lmcompress.compressor.report import CompressionReport
from lmcompress.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass
class Stats:
    """Per-layer calibration statistics (Hessians, input norms, learned logits, ...).

    ``tensors`` holds tensors only and ``meta`` JSON values only (numbers, strings, lists,
    dicts: ``dataclasses.asdict`` of a report, not the report), so that :meth:`save` then
    :meth:`load` gives stats that ``apply`` accepts as it accepts the fresh ones. Tuples come
    back as lists.
    """

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def save(self, path: str | Path) -> None:
        """Write a safetensors file (``meta`` as JSON in its header). Raises ``TypeError``
        naming the key whose value is not JSON, before anything is written."""
        for key, value in self.meta.items():
            try:
                json.dumps(value)
            except (TypeError, ValueError) as err:
                raise TypeError(
                    f"Stats.meta[{key!r}] is not JSON-serialisable ({err}); store plain values "
                    "(e.g. dataclasses.asdict of a report) or tensors in Stats.tensors"
                ) from None
        bad = sorted(k for k, v in self.tensors.items() if not isinstance(v, torch.Tensor))
        if bad:
            raise TypeError(f"Stats.tensors holds non-tensors under {bad}")
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.tensors.items()}
        save_file(tensors, str(path), metadata={"meta": json.dumps(self.meta)})

    @classmethod
    def load(cls, path: str | Path) -> Stats:
        tensors, metadata = read_safetensors(path)
        return cls(tensors=tensors, meta=json.loads(metadata.get("meta", "{}")))


class Method:
    """Base class of every compression method.

    Subclasses set ``config_class`` (a :class:`MethodConfig` subclass), say whether they need
    calibration text, and implement :meth:`calibrate` and :meth:`apply`.
    """

    config_class: ClassVar[type[MethodConfig]] = MethodConfig

    # --- capabilities: declared here, read by the job and by recipes -------------------------
    # Whether the method reads calibration text (a method whose options decide, int8, declares
    # a property instead).
    needs_calibration: ClassVar[bool] = True
    # Whether an export keeps the stats (``stats.safetensors``): learned tensors that another
    # run reuses (MaskLLM's logits), not statistics as large as the model (Fisher factors).
    stats_in_output: ClassVar[bool] = True
    # Whether the method compresses a model it never holds whole (``--streaming``): one block
    # materialised at a time from a block source, through :meth:`compress_streaming`.
    streams: ClassVar[bool] = False
    # The layer formats of an earlier recipe stage (None: unstructured zeros in the dense
    # weight) whose layers this method compresses again, keeping what the earlier stage did
    # (int8 after N:M pruning stores them ``nm_packed_int8``). Empty: a later stage leaves an
    # earlier stage's layers alone. A method whose options decide (GPTQ keeps an earlier mask
    # only with keep_mask) declares a property instead; the job reads it from an instance.
    composes_after: ClassVar[frozenset[str | None]] = frozenset()

    def __init__(self, config: MethodConfig, device: str | torch.device | None = None) -> None:
        """``device``: where calibration computes (``None``: where the model is). Layer-wise
        methods move one block at a time there; the rest of the model stays put."""
        if not isinstance(config, self.config_class):
            raise TypeError(f"{type(self).__name__} takes a {self.config_class.__name__}")
        self.config = config
        self.device = torch.device(device) if device is not None else None

    @property
    def name(self) -> str:
        return self.config.method

    def stored_format(self, layer: str) -> str | None:  # noqa: ARG002
        """The format this method stores ``layer`` in once it compressed it (``None``:
        unstructured zeros in the dense weight): what a later recipe stage composes after
        (``composes_after``), known before any stage runs. Default: ``None``."""
        return None

    def select(self, model: nn.Module) -> dict[str, nn.Module]:
        return LayerSelection(self.config.include, self.config.exclude).select(model)

    def validate(self, model: nn.Module) -> dict[str, nn.Module]:
        """The layers this method will compress; raises ``ConfigError`` if it cannot (checked
        before any expensive work, so a bad option fails in seconds)."""
        return self.select(model)

    def memory_estimate(
        self,
        model: nn.Module,  # noqa: ARG002
        nsamples: int,  # noqa: ARG002
        seq_len: int,  # noqa: ARG002
        itemsize: int = 4,  # noqa: ARG002
    ) -> dict[str, int]:
        """Bytes this method holds at its peak beyond the model's weights, by what holds them
        (``{"calibration activations": ..., "hessians": ...}``), for ``nsamples`` windows of
        ``seq_len`` tokens at ``itemsize`` bytes per value. ``model`` may be a meta-device
        skeleton: use shapes only. The job refuses to start when the sum exceeds the machine's
        memory (see :mod:`lmcompress.compressor.model.budget`). Default: nothing beyond the
        weights."""
        return {}

    def stats_bytes(self, model: nn.Module) -> int:  # noqa: ARG002
        """Bytes of the learned tensors the export keeps beside the model (``stats_in_output``:
        MaskLLM's logits, ...), from shapes only, for the free-space check. Default: none."""
        return 0

    def calibrate(self, model: nn.Module, data: torch.Tensor | None) -> Stats:  # noqa: ARG002
        """Collect statistics on calibration token ids ``data`` of shape (nsamples, seq_len).
        A method that needs no calibration (``needs_calibration = False``) collects none."""
        if self.needs_calibration:
            raise NotImplementedError
        return Stats()

    def apply(self, model: nn.Module, stats: Stats) -> CompressionReport:
        """Compress ``model`` in place using ``stats``; return what was done."""
        raise NotImplementedError

    def compress_streaming(
        self,
        model: nn.Module,
        data: torch.Tensor | None,
        source: BlockSource,
        offload_dir: str | Path | None = None,
    ) -> CompressionReport:
        """Compress a meta-device skeleton whose blocks ``source`` materialises and writes, one
        at a time (``streams = True`` methods only); ``offload_dir``: where the calibration
        activations wait between blocks (``None``: in memory)."""
        raise NotImplementedError(f"{self.name} does not stream")

    def compress(
        self,
        model: nn.Module,
        data: torch.Tensor | None = None,
        source: BlockSource | None = None,
        offload_dir: str | Path | None = None,
    ) -> tuple[CompressionReport, Stats]:
        """Compress ``model`` in place: :meth:`calibrate` on ``data``, then :meth:`apply`.
        With a block ``source`` (a model never whole in memory), :meth:`compress_streaming`."""
        if self.needs_calibration and data is None:
            raise ConfigError(f"method {self.name!r} needs calibration data")
        model.eval()
        if source is not None:
            if not self.streams:
                raise ConfigError(f"method {self.name!r} needs the whole model: it cannot stream")
            report, stats = self.compress_streaming(model, data, source, offload_dir), Stats()
        else:
            stats = self.calibrate(model, data)
            report = self.apply(model, stats)
        logger.info(
            "%s: %d layers compressed in %.1f s", self.name, len(report.layers), report.seconds
        )
        return report, stats
