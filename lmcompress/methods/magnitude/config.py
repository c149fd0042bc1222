from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from lmcompress.methods.pruning import PruningConfig


@dataclass(frozen=True)
class MagnitudeConfig(PruningConfig):
    """Keep the largest-magnitude weights: per layer (unstructured) or per group of M (N:M)."""

    method: ClassVar[str] = "magnitude"
