from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from lmcompress.errors import ConfigError
from lmcompress.methods.pruning import CalibratedPruningConfig

HessianDtype = Literal["float32", "float64"]


@dataclass(frozen=True)
class SparseGPTConfig(CalibratedPruningConfig):
    """SparseGPT: OBS pruning with the layer Hessian 2XXᵀ, updating the kept weights."""

    method: ClassVar[str] = "sparsegpt"

    blocksize: int = field(default=128, metadata={"help": "columns per lazy-update block"})
    percdamp: float = field(default=0.01, metadata={"help": "dampening, fraction of mean diag H"})
    update_weights: bool = field(
        default=True, metadata={"help": "reconstruct the kept weights (off: the mask only)"}
    )
    hessian_dtype: HessianDtype = field(
        default="float32", metadata={"help": "dtype the Hessian is accumulated and solved in"}
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.blocksize < 1:
            raise ConfigError(f"blocksize must be at least 1, got {self.blocksize}")
        if not 0 <= self.percdamp < 1:
            raise ConfigError(f"percdamp must lie in [0, 1), got {self.percdamp}")
