from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from lmcompress.methods.pruning import CalibratedPruningConfig


@dataclass(frozen=True)
class WandaConfig(CalibratedPruningConfig):
    """Wanda: score |W_ij|·‖X_j‖₂ per output row (unstructured) or per group of M (N:M)."""

    method: ClassVar[str] = "wanda"
