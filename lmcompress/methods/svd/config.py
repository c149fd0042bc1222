from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from lmcompress.compressor.config import MethodConfig
from lmcompress.errors import ConfigError


@dataclass(frozen=True)
class SVDConfig(MethodConfig):
    """Plain truncated SVD: replace each selected linear by a rank-r factor pair.

    ``ratio`` is the fraction of the selected layers' parameters KEPT (the ASVD convention):
    0.8 keeps about 80 % of them, i.e. removes about 20 %. Each layer (out m, in n) gets rank
    ``floor(ratio·m·n/(m+n))`` rounded down to a multiple of 8, so the kept count is at most
    ``ratio`` of the layer's and falls short of it only by that rounding. ``ratio = 1`` keeps
    every layer dense.
    """

    method: ClassVar[str] = "svd"

    ratio: float = field(
        default=0.8, metadata={"help": "fraction of the selected layers' parameters kept"}
    )

    def __post_init__(self) -> None:
        super().__post_init__()  # ratio is a finite float from here on
        if not 0.0 < self.ratio <= 1.0:
            raise ConfigError(
                f"ratio {self.ratio!r} must lie in (0, 1]: the fraction of parameters kept"
            )
