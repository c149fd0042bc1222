from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from lmcompress.compressor.config import MethodConfig, Sparsity, parse_sparsity


@dataclass(frozen=True)
class MagnitudeConfig(MethodConfig):
    """Keep the largest-magnitude weights: per layer (unstructured) or per group of M (N:M)."""

    method: ClassVar[str] = "magnitude"

    sparsity: str = field(
        default="2:4",
        metadata={"help": "N:M pattern (keep N of every M input weights) or fraction removed"},
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "sparsity", str(parse_sparsity(self.sparsity)))

    @property
    def pattern(self) -> Sparsity:
        return parse_sparsity(self.sparsity)
