"""Which rank each layer gets under a parameter budget (pure integer arithmetic).

A rank-r factorisation of an ``m × n`` weight stores ``r·(m + n)`` parameters, so keeping a
fraction ``ratio`` of them allows ``r = floor(ratio·m·n / (m + n))``. The rank is rounded down
to a multiple of :data:`RANK_MULTIPLE` (8): matmul kernels tile the inner dimension in
multiples of 8 (fp16 tensor cores, CPU vector widths), and rounding down keeps the layer
within its budget.
"""

from __future__ import annotations

import math

RANK_MULTIPLE = 8


def budget_rank(
    out_features: int, in_features: int, ratio: float, multiple: int = RANK_MULTIPLE
) -> int | None:
    """The rank that keeps at most ``ratio`` of an ``out × in`` weight's parameters, or
    ``None`` when the layer should stay dense: the dense layer already fits the budget
    (``ratio >= 1``), the rank rounds down to 0, or the factors would not be smaller than the
    dense weight (``r·(m + n) >= m·n``)."""
    m, n = out_features, in_features
    if ratio >= 1.0:
        return None
    rank = math.floor(ratio * m * n / (m + n)) // multiple * multiple
    if rank == 0 or rank * (m + n) >= m * n:
        return None
    return rank
