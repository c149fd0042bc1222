"""Generic helpers of learned masks, shared by every method that learns one (MaskLLM's N:M
patterns, subnetwork extraction's keep logits): the candidate patterns of an N:M group, Gumbel
noise sources (fresh, pooled, counter-based, replayable), and the linear schedules of the
temperature and scale. Pure torch, no method's names.

``GumbelPool`` and ``counter_gumbel`` are cheaper noise sources than ``gumbel_noise`` (the
second one fresh on every call, like it, and computed inside the fused CPU kernel,
:mod:`lmcompress.kernels.soft_mask`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Literal, get_args

import torch

# Where the Gumbel noise comes from: fresh samples (torch's generator), windows of a pre-drawn
# pool, or fresh samples from a counter-based hash (``counter_gumbel``, drawn inside the kernel).
Noise = Literal["exact", "pool", "counter"]
NOISES: tuple[str, ...] = get_args(Noise)


def candidate_patterns(n: int, m: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """All ``C(m, n)`` patterns with ``n`` ones among ``m``, as rows: (C, m)."""
    rows = [
        [1 if j in kept else 0 for j in range(m)] for kept in itertools.combinations(range(m), n)
    ]
    return torch.tensor(rows, dtype=dtype)


def gumbel_noise(shape: torch.Size | tuple[int, ...], generator=None, device=None) -> torch.Tensor:
    """Standard Gumbel samples ``−log(−log U)``, U ~ Uniform(0, 1)."""
    u = torch.rand(shape, generator=generator, device=device).clamp_(1e-10, 1.0 - 1e-7)
    return u.log_().neg_().log_().neg_()  # in place: no temporaries of the noise's size


def _signed(value: int) -> int:
    """A uint64 constant as the int64 with the same bits (torch has no uint64 arithmetic)."""
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN, _MIX1, _MIX2 = (_signed(v) for v in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9,
                                                0x94D049BB133111EB))  # fmt: skip


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's ``>>`` is arithmetic)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def counter_gumbel(shape: torch.Size | tuple[int, ...], seed: int) -> torch.Tensor:
    """Gumbel(0, 1) values that depend only on ``seed`` and the flat index ``i``: the top 23 bits
    of splitmix64(seed + i·φ) give U = (bits + 0.5) / 2^23 (exact in float32, inside (0, 1)),
    the value −log(−log U) (float32).
    What the fused kernel draws for noise "counter", in torch (its reference, and the path
    for layers the kernel does not take). A new seed a call gives fresh noise as ``exact``
    does, and the same seed replays it (the backward pass) without storing it."""
    numel = math.prod(shape)
    z = torch.arange(numel, dtype=torch.int64) * _GOLDEN + _signed(seed % (1 << 64))
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    bits = _shift_right(z ^ _shift_right(z, 31), 41)
    u = (bits.float() + 0.5) * (1.0 / (1 << 23))
    return u.log_().neg_().log_().neg_().reshape(shape)


class GumbelPool:
    """A fixed pool of ``size`` standard Gumbel values, handed out as random circular windows.

    The pool is drawn once with ``gumbel_noise`` from its own generator (``seed``), so creating
    it leaves torch's global RNG untouched. Every ``sample`` call draws one offset ``o`` from
    torch's global CPU RNG (reproducible under ``torch.manual_seed``) and returns the values
    ``pool[(o + i) mod size]``, i = 0 … numel − 1, in row-major order.

    What is kept: each returned value is marginally an exact Gumbel(0, 1) sample (the pool's
    values are i.i.d. and the offset is independent of them), and the ``C`` values of one group
    are ``C`` distinct consecutive pool entries (for ``size ≥ C``), so per group the Gumbel-max
    trick stays exact: ``P(argmax(κ·logits + g) = c) = softmax(κ·logits)_c``.
    What is given up: the same ``size`` values are reused by every call, so samples are
    correlated across calls (masks, steps); windows longer than the pool repeat it, so groups a
    multiple of ``size`` values apart within one call get identical noise (groups
    ``size / gcd(size, C)`` apart: 2^21 for the default 2^22 values and C = 6); and given the
    pool, values come from its empirical distribution.

    Speed (a shared 2-core CPU under load from other jobs, float32, median of 3-9 calls,
    result allocation included; ``torch.get_num_threads() == 2`` unless said): ``gumbel_noise``
    for 1M × 6 values takes 115-200 ms (``torch.rand``, single-threaded mt19937, 45-65 ms of
    it, the clamp and two logs the rest; a seeded ``torch.Generator`` is no faster than the
    global RNG), ``sample`` 24 ms (3.3 ms with 1 thread, where the 2-thread copy waits on the
    busy second core); for 26M × 6 values (all of SmolLM2-135M's logits in one call) 2.3-5.7 s
    against 0.3-0.65 s. Net: 7-35x less time for the noise, which becomes one memory copy.
    """

    def __init__(self, size: int = 1 << 22, seed: int = 0) -> None:
        if size < 1:
            raise ValueError(f"pool size must be positive, got {size}")
        self.size = size
        self.values = gumbel_noise((size,), generator=torch.Generator().manual_seed(seed))
        self._doubled: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def doubled(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """The pool twice over, ``(2·size,)``, cached per device and dtype: every circular
        window of at most ``size`` values is then one contiguous slice."""
        key = (device, dtype)
        if key not in self._doubled:
            self._doubled[key] = self.values.repeat(2).to(device=device, dtype=dtype)
        return self._doubled[key]

    def sample(
        self,
        shape: torch.Size | tuple[int, ...],
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
        offset: int | None = None,
    ) -> torch.Tensor:
        """A fresh tensor of ``shape``: the pool's circular window at ``offset`` (by default a
        random one from the global RNG; pass it to draw the same window again)."""
        device = torch.device("cpu") if device is None else torch.device(device)
        numel = math.prod(shape)
        if offset is None:
            offset = int(torch.randint(self.size, ()))
        window = self.doubled(device, dtype)[offset : offset + self.size]
        out = torch.empty(numel, device=device, dtype=dtype)
        whole, rest = divmod(numel, self.size)
        out[: whole * self.size].view(whole, self.size).copy_(window)  # broadcast over rows
        out[whole * self.size :].copy_(window[:rest])
        return out.view(shape)


_SHARED_POOL: GumbelPool | None = None


def shared_gumbel_pool() -> GumbelPool:
    """The process-wide ``GumbelPool()`` (2^22 values, seed 0), created on first use."""
    global _SHARED_POOL
    if _SHARED_POOL is None:
        _SHARED_POOL = GumbelPool()
    return _SHARED_POOL


def pooled_gumbel_noise(
    shape: torch.Size | tuple[int, ...],
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Gumbel(0, 1) noise of ``shape`` from ``shared_gumbel_pool()`` (see ``GumbelPool``)."""
    return shared_gumbel_pool().sample(shape, device=device, dtype=dtype)


def replayable_noise(
    source: str,
    shape: torch.Size | tuple[int, ...],
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> Callable[[], torch.Tensor]:
    """A function that returns the *same* Gumbel(0, 1) sample of ``shape`` each time it is
    called: "exact" draws a seed from the global RNG and regenerates ``gumbel_noise`` from it,
    "pool" draws a window offset of the shared :class:`GumbelPool`."""
    if source == "exact":
        seed = int(torch.randint(2**62, ()))

        def exact() -> torch.Tensor:
            generator = torch.Generator(device=device or "cpu").manual_seed(seed)
            return gumbel_noise(shape, generator=generator, device=device).to(dtype)

        return exact
    if source == "pool":
        pool = shared_gumbel_pool()
        offset = int(torch.randint(pool.size, ()))
        return lambda: pool.sample(shape, device=device, dtype=dtype, offset=offset)
    if source == "counter":
        seed = int(torch.randint(2**62, ()))
        return lambda: counter_gumbel(shape, seed).to(device=device, dtype=dtype)
    raise ValueError(f"noise must be one of {NOISES}, got {source!r}")


def linear_schedule(start: float, end: float, step: int, total: int) -> float:
    """``start`` at step 0, ``end`` at step ``total``, linear in between (the paper's τ, κ)."""
    if total <= 0:
        return end
    return start + (end - start) * min(max(step / total, 0.0), 1.0)
