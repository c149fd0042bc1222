"""Which rank each layer gets under a parameter budget: one ratio for all, or allocated.

A rank-r factorisation of an ``m × n`` weight stores ``r·(m + n)`` parameters, so keeping a
fraction ``ratio`` of them allows ``r = floor(ratio·m·n / (m + n))``. The rank is rounded down
to a multiple of :data:`RANK_MULTIPLE` (8): matmul kernels tile the inner dimension in
multiples of 8 (fp16 tensor cores, CPU vector widths), and rounding down keeps the layer
within its budget.
"""

from __future__ import annotations

import heapq
import logging
import math
from collections.abc import Iterable

import torch

logger = logging.getLogger(__name__)

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


def smallest_ratio(
    shapes: Iterable[tuple[int, int]], multiple: int = RANK_MULTIPLE
) -> tuple[float, int] | None:
    """The smallest ratio at which :func:`budget_rank` factorises at least one of the
    ``(out, in)`` shapes, rounded up to three significant digits (a ratio one can type), and
    the index of that shape; ``None`` when no shape is large enough for rank-``multiple``
    factors to be smaller than its dense weight.

    Rank ``multiple`` needs ``ratio·m·n/(m + n) >= multiple``, so the bound of an ``m × n``
    layer is ``multiple·(m + n)/(m·n)``: the layer with the most parameters per unit of
    ``m + n`` (the widest) compresses first."""
    best = None
    for index, (m, n) in enumerate(shapes):
        if multiple * (m + n) < m * n and (best is None or (m + n) / (m * n) < best[0]):
            best = ((m + n) / (m * n), index, m, n)
    if best is None:
        return None
    _, index, m, n = best
    ratio = _round_up(multiple * (m + n) / (m * n))
    while budget_rank(m, n, ratio, multiple) is None:  # floor() of the rounded product
        ratio = _round_up(ratio * (1 + 1e-3))
    return ratio, index


def smallest_greedy_ratio(
    shapes: Iterable[tuple[int, int]], multiple: int = RANK_MULTIPLE
) -> float:
    """The smallest ratio whose budget covers :func:`allocate_ranks`' starting point, rank
    ``multiple`` in every layer (or the dense layer where that is smaller), rounded up to three
    significant digits; below it the allocation keeps more than the ratio asks."""
    shapes = list(shapes)
    total = sum(m * n for m, n in shapes)
    floor = sum(min(min(multiple, m, n) * (m + n), m * n) for m, n in shapes)
    ratio = _round_up(floor / total)
    while ratio * total < floor:  # the comparison allocate_ranks makes
        ratio = _round_up(ratio * (1 + 1e-3))
    return ratio


def _round_up(value: float, digits: int = 3) -> float:
    """``value`` rounded up to ``digits`` significant digits."""
    scale = 10.0 ** (math.floor(math.log10(value)) - digits + 1)
    return float(f"{math.ceil(value / scale) * scale:.{digits}g}")


def dense_rank(out_features: int, in_features: int, multiple: int = RANK_MULTIPLE) -> int:
    """The smallest multiple of ``multiple`` whose factors store at least the dense weight's
    parameters: from there on the layer is better kept dense."""
    m, n = out_features, in_features
    return -(-(m * n) // ((m + n) * multiple)) * multiple


def allocate_ranks(
    spectra: dict[str, tuple[int, int, torch.Tensor]],
    ratio: float,
    *,
    relative: bool = True,
    multiple: int = RANK_MULTIPLE,
) -> dict[str, int | None]:
    """Ranks for all layers at once under one parameter budget, ``ratio · Σ m·n``, greedily
    by the weighted truncation error each parameter buys.

    ``spectra[name] = (m, n, s)``: the layer's shape and the singular values ``s`` (descending)
    of its weighted matrix, so that truncating at rank r costs ``e(r) = Σ_{i>r} s_i²`` in the
    method's weighted norm. With ``relative`` the errors are divided by the layer's total
    ``Σ s_i²`` (for weightings whose units differ between layers: plain, activation-aware and
    whitened SVD); without, they are compared as they are (Fisher weightings, whose error
    estimates the loss increase in the same units for every layer).

    Every layer starts at rank ``multiple``; each step adds ``multiple`` to the rank of the
    layer whose next step removes the most error per added parameter, while the budget allows.
    A layer whose rank reaches :func:`dense_rank` is kept dense (``None``): the last step costs
    only what the dense weight needs beyond the factors and removes all of the error left.
    Returns ``{name: rank or None}``; the kept parameters never exceed the budget (when even
    rank ``multiple`` everywhere exceeds it, those minimal ranks are returned and a warning is
    logged).
    """
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"ratio must lie in (0, 1], got {ratio}")
    budget = ratio * sum(m * n for m, n, _ in spectra.values())
    tails: dict[str, torch.Tensor] = {}  # tails[name][r] = e(r), r = 0..len(s)
    ranks: dict[str, int] = {}
    used = 0.0
    for name, (m, n, s) in spectra.items():
        energy = s.double().square()
        tail = energy.flip(0).cumsum(0).flip(0)  # tail[r] = Σ_{i>=r} s_i²
        tail = torch.cat([tail, tail.new_zeros(1)])
        if relative:
            tail = tail / tail[0].clamp_min(1e-300)
        tails[name] = tail
        ranks[name] = min(multiple, min(m, n))
        used += min(ranks[name] * (m + n), m * n)

    def step(name: str) -> tuple[float, int, float] | None:
        """(-gain per parameter, next rank, added parameters) of layer ``name``'s next step."""
        m, n, _ = spectra[name]
        rank = ranks[name]
        if rank * (m + n) >= m * n or rank >= min(m, n):
            return None  # dense already
        nxt = rank + multiple
        cost_now = rank * (m + n)
        if nxt >= dense_rank(m, n, multiple) or nxt >= min(m, n):
            nxt, cost = dense_rank(m, n, multiple), m * n - cost_now
            gain = float(tails[name][min(rank, len(tails[name]) - 1)])
        else:
            cost = multiple * (m + n)
            gain = float(tails[name][rank] - tails[name][nxt])
        return (-gain / max(cost, 1), nxt, cost)

    heap = []
    for name in spectra:
        if (nxt := step(name)) is not None:
            heapq.heappush(heap, (nxt[0], name, nxt[1], nxt[2]))
    while heap:
        _, name, nxt, cost = heapq.heappop(heap)
        if used + cost > budget:
            continue  # this layer cannot grow; others may still fit
        ranks[name], used = nxt, used + cost
        if (following := step(name)) is not None:
            heapq.heappush(heap, (following[0], name, following[1], following[2]))
    if used > budget:
        logger.warning(
            "ratio %g is below what rank %d in every layer needs; using rank %d everywhere",
            ratio,
            multiple,
            multiple,
        )
    return {
        name: None if r * (m + n) >= m * n or r >= min(m, n) else r
        for name, (m, n, _), r in ((k, spectra[k], ranks[k]) for k in spectra)
    }
