"""What the pruning methods (magnitude, Wanda, SparseGPT) share: the config with the target
sparsity and per-layer overrides, and the base class of calibrated (layer-wise) pruners."""

from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from lmcompress.compressor.config import MethodConfig, Sparsity, parse_sparsity
from lmcompress.compressor.method import Method
from lmcompress.compressor.model.surgery import weight_matrix
from lmcompress.compressor.report import LayerReport
from lmcompress.compressor.sparsity import check_nm_shape
from lmcompress.errors import ConfigError, shown
from lmcompress.methods.layerwise import LayerwiseMethod

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


class LayerwisePruningMethod(PruningMethod, LayerwiseMethod):
    """A pruner that needs each layer's calibration inputs (Wanda, SparseGPT): a
    :class:`~lmcompress.methods.layerwise.LayerwiseMethod` whose layer computation is
    :meth:`prune`, a pure function of the weight, the statistic (Wanda's input norms,
    SparseGPT's Hessian) and the layer's sparsity. Subclasses implement
    :meth:`make_accumulator`, :meth:`statistic_of` and :meth:`prune`, and name their
    ``statistic``."""

    def prune(
        self, name: str, module: nn.Module, statistic: torch.Tensor, sparsity: Sparsity
    ) -> LayerReport:
        """Prune ``module`` in place from its ``statistic``; report it."""
        raise NotImplementedError

    def compress_layer(
        self,
        model: nn.Module,  # noqa: ARG002
        name: str,
        module: nn.Module,
        statistic: torch.Tensor,
    ) -> LayerReport:
        return self.prune(name, module, statistic, self.config.sparsity_of(name))
