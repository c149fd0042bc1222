"""What a compression run did, per layer and overall; round-trips through JSON."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from typing import Any

import torch


@torch.no_grad()
def relative_error(original: torch.Tensor, approx: torch.Tensor) -> float:
    """``‖W − Ŵ‖_F / ‖W‖_F`` of a weight ``original`` (out, in) and what replaced it, in
    float32; the denominator is floored at 1e-30 so that an all-zero weight gives no NaN."""
    W = original.float()
    return float((W - approx.float()).norm() / W.norm().clamp_min(1e-30))


@dataclass
class LayerReport:
    """One compressed layer. ``rel_error`` is ``||W - W_hat|| / ||W||`` unless the method
    measured the relative *output* error on calibration inputs (``error_kind``)."""

    name: str
    shape: tuple[int, int]  # (out_features, in_features)
    params: int  # parameters before
    params_kept: int  # nonzero / stored parameters after
    bytes_dense: int  # bytes of the dense weight in the model's dtype
    bytes_compressed: int  # bytes of the compressed form (packed values + metadata, ...)
    sparsity: float | None = None  # fraction of weights that are zero
    pattern: str | None = None  # "2:4", "0.5" (unstructured), ...
    rank: int | None = None
    bits: int | None = None
    rel_error: float | None = None
    error_kind: str = "weight"
    seconds: float = 0.0
    # How export stores the layer: a name in the format registry (``formats.registry``;
    # ``None``: the dense weight is the stored form, e.g. unstructured zeros) and the options its
    # ``from_linear`` takes (``{"n": 2, "m": 4}`` for ``nm_packed``).
    format: str | None = None
    format_options: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # method-specific numbers (JSON)

    @classmethod
    def measure(
        cls,
        name: str,
        original: torch.Tensor,
        approx: torch.Tensor | None,
        started: float,
        *,
        params_kept: int,
        bytes_compressed: int,
        **fields: Any,
    ) -> LayerReport:
        """The report of layer ``name`` whose weight ``original`` (out, in) now computes as
        ``approx`` (``None``: the layer stayed as it was, error 0): the fields every method
        fills the same way (shape, parameters and dense bytes of ``original``, the relative
        weight error, the seconds since ``started``, a ``time.perf_counter()`` reading) and
        ``fields`` (sparsity, rank, bits, format, ...). ``original`` must not alias ``approx``'s
        storage when both are given: a layer changed in place passes a copy of its old weight.
        """
        numel = original.numel()
        return cls(
            name=name,
            shape=tuple(original.shape),
            params=numel,
            params_kept=params_kept,
            bytes_dense=numel * original.element_size(),
            bytes_compressed=bytes_compressed,
            rel_error=0.0 if approx is None else relative_error(original, approx),
            seconds=time.perf_counter() - started,
            **fields,
        )

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> LayerReport:
        values = dict(values)
        values["shape"] = tuple(values["shape"])
        return cls(**values)


@dataclass
class CompressionReport:
    """What one method did to a model: a :class:`LayerReport` per compressed layer, the
    method's ``config`` as a dict, ``summary()`` totals (parameters kept, dense and compressed
    bytes); ``to_json`` / ``from_json`` round-trip it (``compression.json`` records it)."""

    method: str
    config: dict[str, Any]
    layers: list[LayerReport] = field(default_factory=list)
    seconds: float = 0.0
    model_params: int = 0  # every parameter of the model, before compression
    extra: dict[str, Any] = field(default_factory=dict)  # method-specific results

    @property
    def params(self) -> int:
        return sum(layer.params for layer in self.layers)

    @property
    def params_kept(self) -> int:
        return sum(layer.params_kept for layer in self.layers)

    @property
    def bytes_dense(self) -> int:
        return sum(layer.bytes_dense for layer in self.layers)

    @property
    def bytes_compressed(self) -> int:
        return sum(layer.bytes_compressed for layer in self.layers)

    def summary(self) -> dict[str, Any]:
        """Totals over the compressed layers (and the whole model)."""
        return {
            "method": self.method,
            "layers": len(self.layers),
            "params_compressed_layers": self.params,
            "params_kept": self.params_kept,
            "model_params": self.model_params,
            "model_params_after": self.model_params - self.params + self.params_kept,
            "bytes_dense": self.bytes_dense,
            "bytes_compressed": self.bytes_compressed,
            "seconds": round(self.seconds, 3),
        }

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["summary"] = self.summary()
        return out

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> CompressionReport:
        values = {k: v for k, v in values.items() if k != "summary"}
        values["layers"] = [LayerReport.from_dict(layer) for layer in values.get("layers", [])]
        return cls(**values)

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_json(cls, text: str) -> CompressionReport:
        return cls.from_dict(json.loads(text))
