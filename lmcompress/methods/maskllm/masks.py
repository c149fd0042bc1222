"""MaskLLM (Fang et al., NeurIPS 2024, arXiv 2409.17481): the math of learnable N:M masks.

Every group of ``m`` consecutive input weights of an ``(out, in)`` weight owns one logit per
candidate pattern (all ``C(m, n)`` binary vectors with ``n`` ones; 6 for 2:4). Training uses a
soft mask, a Gumbel-softmax-weighted average of the candidates::

    mask = softmax((κ · logits + g) / τ) @ candidates,   g ~ Gumbel(0, 1)        (Eq. 4-5)

so every group's mask sums to exactly ``n``; inference takes the argmax candidate, an exact
N:M mask. A one-shot mask ``M0`` is a prior (Sec. 3.3)::

    logits += α · std(logits) · (overlap(candidate, M0 group) − n / 2)

Straight-through training (``soft_mask(..., hard=True)``) uses the sampled argmax pattern,
``onehot(argmax(κ · logits + g)) @ candidates``, in the forward pass and the soft mask's
gradient in the backward pass. ``GumbelPool`` and ``counter_gumbel`` are cheaper noise sources
than ``gumbel_noise`` (the second one fresh on every call, like it, and computed inside the fused
CPU kernel, :mod:`lmcompress.kernels.soft_mask`).
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


def init_logits(
    groups: int, candidates: int, std: float = 0.01, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Logits (groups, C) drawn from N(0, std²), the paper's initialisation."""
    return torch.randn(groups, candidates, generator=generator) * std


def prior_logits(
    logits: torch.Tensor,
    prior_keep: torch.Tensor,
    candidates: torch.Tensor,
    strength: float = 3.0,
    exact: bool = True,
) -> torch.Tensor:
    """Shift ``logits`` (G, C) towards the candidates that agree with ``prior_keep`` (G, m).

    With ``exact``, groups whose argmax would not be the prior's best candidate (the init noise
    is as large as the prior's margin: ~5 % of groups for α = 3) get that candidate's logit raised
    to the group's maximum plus half the margin, so the step-0 hard mask *is* the prior.
    """
    n = candidates[0].sum()
    overlap = prior_keep.to(candidates.dtype) @ candidates.T  # (G, C): shared ones, 0..n
    margin = strength * logits.std()
    shifted = logits + margin * (overlap - n / 2)
    if exact:
        best = overlap.argmax(dim=1)  # (G,) the candidate closest to the prior group
        best_logit = shifted.gather(1, best[:, None])  # (G, 1)
        others = shifted.scatter(1, best[:, None], float("-inf")).amax(1, keepdim=True)
        raised = torch.where(best_logit > others, best_logit, others + margin / 2)
        shifted = shifted.scatter(1, best[:, None], raised)
    return shifted


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


def soft_mask(
    logits: torch.Tensor,
    candidates: torch.Tensor,
    tau: float,
    kappa: float,
    noise: torch.Tensor | None = None,
    *,
    hard: bool = False,
) -> torch.Tensor:
    """Differentiable mask (G, m): ``softmax((κ·logits + noise) / τ) @ candidates``.

    With ``hard``, straight-through: the forward value is the candidate at
    ``argmax(κ·logits + noise)`` (exactly N:M per group, the Gumbel-max sample), the gradient
    is the soft mask's. It is written ``hard + (soft − soft.detach())`` so that the forward
    value is exactly 0/1 (``x − x = 0`` in floating point).
    """
    scores = logits * kappa if noise is None else logits * kappa + noise
    soft = torch.softmax(scores / tau, dim=-1) @ candidates  # (G, C) @ (C, m)
    if not hard:
        return soft
    sampled = candidates[scores.detach().argmax(dim=-1)]  # (G, m)
    return sampled + (soft - soft.detach())


# Soft-mask entries below this are set to 0 in the forward value. At small τ the softmax gives
# values like e^-100, and W ⊙ mask then holds subnormal floats, which make every CPU GEMM with
# that weight ~90x slower (measured: a 512×576 @ 576×1536 matmul, 5 ms -> 0.46 s; flushing
# denormals with torch.set_flush_denormal did not help). In the paper's schedule this slowed the
# last 5 % of the steps of an end-to-end SmolLM2 run from 12 s to over 150 s. An entry below
# 1e-12 changes no float32 output of the layer; the backward still uses the exact softmax.
MASK_FLOOR = 1e-12


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


class _ReplayedSoftMask(torch.autograd.Function):
    """:func:`soft_mask` (optionally straight-through) that keeps no (G, C) tensor between
    forward and backward: the backward replays the noise and recomputes the softmax. Autograd
    would otherwise hold the probabilities of every layer until the backward pass (636 MB for
    SmolLM2-135M's 159M logits); the price is a second noise draw per step."""

    @staticmethod
    def forward(ctx, logits, candidates, tau, kappa, noise_fn, hard):  # noqa: ANN001
        # in the logits' dtype even under autocast (a bf16 ``@`` would round the mask, and the
        # backward below works in the logits' dtype)
        with torch.autocast(logits.device.type, enabled=False):
            scores = logits * kappa + noise_fn()  # (G, C)
            if hard:
                out = candidates[scores.argmax(dim=-1)]
            else:
                out = torch.softmax(scores.div_(tau), dim=-1) @ candidates
                out.masked_fill_(out < MASK_FLOOR, 0.0)  # no subnormal weights (see MASK_FLOOR)
        ctx.save_for_backward(logits, candidates)
        ctx.tau, ctx.kappa, ctx.noise_fn = tau, kappa, noise_fn
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001
        logits, candidates = ctx.saved_tensors
        grad = grad.to(logits.dtype)
        p = torch.softmax((logits * ctx.kappa + ctx.noise_fn()).div_(ctx.tau), dim=-1)  # (G, C)
        dp = grad @ candidates.T  # dL/dp, (G, C)
        # softmax Jacobian-vector product: p ⊙ (dp − <p, dp>), then d scores / d logits = κ/τ
        ds = p.mul_(dp - (p * dp).sum(dim=-1, keepdim=True)).mul_(ctx.kappa / ctx.tau)
        return ds, None, None, None, None, None


def soft_mask_replayed(
    logits: torch.Tensor,
    candidates: torch.Tensor,
    tau: float,
    kappa: float,
    noise_fn: Callable[[], torch.Tensor],
    hard: bool = False,
) -> torch.Tensor:
    """The same value and gradient as ``soft_mask(logits, candidates, tau, kappa, noise_fn(),
    hard=hard)``, with less memory held for backward (see ``_ReplayedSoftMask``)."""
    return _ReplayedSoftMask.apply(logits, candidates, tau, kappa, noise_fn, hard)


def hard_mask(logits: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """The argmax candidate of every group (G, m): exactly N:M."""
    return candidates[logits.argmax(dim=-1)]


def linear_schedule(start: float, end: float, step: int, total: int) -> float:
    """``start`` at step 0, ``end`` at step ``total``, linear in between (the paper's τ, κ)."""
    if total <= 0:
        return end
    return start + (end - start) * min(max(step / total, 0.0), 1.0)
