"""Observers: running statistics of the tensors entering or leaving any module.

Methods calibrate on statistics of activations: int8 needs ranges (absmax, min/max per channel
or per tensor), Wanda needs mean |x| per input channel, svd-llm the Gram matrix Σ xxᵀ
(:class:`GramObserver`) and SparseGPT its running Hessian 2/n · Σ xxᵀ
(:class:`HessianAccumulator`). Each observer is a small accumulator: ``update(x)`` folds one
batch in (no autograd, float32 accumulators unless stated, every leading dimension treated as
tokens, the last one as channels) and a property reads the result. ``add_batch`` is the same
call, so an observer serves as a layer-wise accumulator (``compressor/layerwise.py``) too.

:func:`observe` attaches observers to modules by qualified name, on their input or output, for
the length of a ``with`` block.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import nn

from lmcompress.compressor.model.surgery import forward_hooks
from lmcompress.errors import ConfigError

Side = Literal["input", "output"]


def _tokens(x: torch.Tensor) -> torch.Tensor:
    """``x`` as float32 (tokens, channels): every leading dimension is a token dimension."""
    x = x.detach()
    if x.dim() == 0:
        x = x.reshape(1)
    return x.reshape(-1, x.shape[-1]).float()  # (N, C)


class Observer:
    """Base class: ``update(x)`` turns ``x`` into rows (:meth:`rows`), skips an empty batch,
    folds the rows in (``_update``) and counts them in ``tokens``."""

    def __init__(self) -> None:
        self.tokens = 0

    @torch.no_grad()
    def update(self, x: torch.Tensor) -> None:
        rows = self.rows(x)
        if rows.shape[0] == 0:
            return
        self._update(rows)
        self.tokens += rows.shape[0]

    def add_batch(self, x: torch.Tensor) -> None:
        """Alias of :meth:`update` (the layer-wise loop's accumulator protocol)."""
        self.update(x)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as the (tokens, channels) rows :meth:`_update` folds in: float32, on ``x``'s
        device (an accumulator with another dtype or device overrides this)."""
        return _tokens(x)

    def _update(self, rows: torch.Tensor) -> None:  # rows: (N, C), as :meth:`rows` gives them
        raise NotImplementedError

    def _require_data(self) -> None:
        if self.tokens == 0:
            raise ValueError(f"{type(self).__name__} has observed nothing yet")


def _fold(acc: torch.Tensor | None, new: torch.Tensor, op: Any, name: str) -> torch.Tensor:
    if acc is None:
        return new
    if acc.shape != new.shape:
        raise ValueError(f"{name}: channels changed from {tuple(acc.shape)} to {tuple(new.shape)}")
    return op(acc, new.to(acc.device))


class AbsMaxObserver(Observer):
    """Running max |x|: a scalar, or one value per channel (last dim) with ``per_channel``."""

    def __init__(self, per_channel: bool = False) -> None:
        super().__init__()
        self.per_channel = per_channel
        self._absmax: torch.Tensor | None = None

    def _update(self, rows: torch.Tensor) -> None:
        new = rows.abs().amax(dim=0) if self.per_channel else rows.abs().amax()
        self._absmax = _fold(self._absmax, new, torch.maximum, "AbsMaxObserver")

    @property
    def absmax(self) -> torch.Tensor:  # () or (C,)
        self._require_data()
        return self._absmax


class MinMaxObserver(Observer):
    """Running min and max: scalars, or one per channel (last dim) with ``per_channel``."""

    def __init__(self, per_channel: bool = False) -> None:
        super().__init__()
        self.per_channel = per_channel
        self._min: torch.Tensor | None = None
        self._max: torch.Tensor | None = None

    def _update(self, rows: torch.Tensor) -> None:
        dims = {"dim": 0} if self.per_channel else {}
        self._min = _fold(self._min, rows.amin(**dims), torch.minimum, "MinMaxObserver")
        self._max = _fold(self._max, rows.amax(**dims), torch.maximum, "MinMaxObserver")

    @property
    def min(self) -> torch.Tensor:  # () or (C,)
        self._require_data()
        return self._min

    @property
    def max(self) -> torch.Tensor:  # () or (C,)
        self._require_data()
        return self._max


class MeanAbsObserver(Observer):
    """Mean |x| per channel (last dim) over every token seen (Σ|x| kept in float32)."""

    def __init__(self) -> None:
        super().__init__()
        self._sum: torch.Tensor | None = None

    def _update(self, rows: torch.Tensor) -> None:
        self._sum = _fold(self._sum, rows.abs().sum(dim=0), torch.add, "MeanAbsObserver")

    @property
    def mean_abs(self) -> torch.Tensor:  # (C,)
        self._require_data()
        return self._sum / self.tokens


class GramObserver(Observer):
    """Σ xxᵀ over tokens, (C, C) in float32, with the token count: svd-llm's Gram matrix.

    Each batch is one GEMM ``XᵀX`` added to the sum (on the first batch's device), and the sum
    is read as it is (:attr:`gram`). :meth:`hessian` gives ``2/n · Σ xxᵀ`` from it;
    SparseGPT's own Hessian is :class:`HessianAccumulator`, which folds batches in as a running
    mean (see there why the two are not one computation).
    """

    def __init__(self) -> None:
        super().__init__()
        self._sum: torch.Tensor | None = None

    def _update(self, rows: torch.Tensor) -> None:
        self._sum = _fold(self._sum, rows.T @ rows, torch.add, "GramObserver")  # (C, C)

    @property
    def gram(self) -> torch.Tensor:  # (C, C): Σ xxᵀ
        self._require_data()
        return self._sum

    def hessian(self) -> torch.Tensor:
        """``2/n · Σ xxᵀ`` (n = tokens), the Hessian of ``‖WX − ŴX‖²`` averaged over tokens."""
        return self.gram * (2.0 / self.tokens)


class HessianAccumulator(Observer):
    """Running ``H = 2/n · Σ_t x_t x_tᵀ`` over the ``n`` input tokens of one linear layer:
    SparseGPT's Hessian (:mod:`lmcompress.methods.sparsegpt.solver`), also what the one-shot
    priors and the mask re-fit use.

    Each batch rescales the old mean, ``H ← H · n_old / n_new``, and adds
    ``2/n_new · XᵀX`` of the new tokens (one GEMM), as the reference ``add_batch`` does, so the
    result is the same however the tokens are split into batches (up to float rounding).
    ``H`` (in, in) is allocated up front on ``device``, in float32 or float64 (``dtype``); the
    inputs are cast to it before the GEMM, and their width is checked (a :class:`ConfigError`).

    Why not :class:`GramObserver` with a different read-out: the fused, rescaling GEMM rounds
    differently from a sum of GEMMs divided at the end (on the same inputs the two differ in the
    last bits, as does a plain ``addmm_`` sum), and SparseGPT's masks and weights follow H's
    rounding; both folds are kept exactly, and share the :class:`Observer` pipeline (rows, empty
    batches, token count, ``add_batch``, :func:`observe`).
    """

    def __init__(
        self, in_features: int, device: torch.device | str = "cpu", dtype=torch.float32
    ) -> None:
        if dtype not in (torch.float32, torch.float64):
            raise ConfigError(f"Hessian dtype must be float32 or float64, got {dtype}")
        super().__init__()
        self.in_features = in_features
        self._H = torch.zeros(in_features, in_features, device=device, dtype=dtype)  # (in, in)

    @property
    def H(self) -> torch.Tensor:
        """The current Hessian, (in, in). The live buffer: clone it before changing it."""
        return self._H

    @property
    def nsamples(self) -> int:
        """Tokens seen (SparseGPT's name for :attr:`tokens`)."""
        return self.tokens

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """The inputs ``x`` (..., in_features) as (tokens, in) in H's dtype, on H's device."""
        if x.shape[-1] != self.in_features:
            raise ConfigError(
                f"inputs have {x.shape[-1]} features, the accumulator expects {self.in_features}"
            )
        return x.reshape(-1, self.in_features).to(self._H.device, self._H.dtype)  # (t, in)

    def mirror(self, other: Observer) -> bool:
        """Take ``other``'s state (a copy) where it is an accumulator of this kind, size, dtype
        and device (then True): what :class:`SharedInputFeed` does for a layer fed the very
        tensor ``other`` was just fed, their states equal before it."""
        if type(other) is not type(self):
            return False
        H, theirs = self._H, other._H
        if (H.shape, H.dtype, H.device) != (theirs.shape, theirs.dtype, theirs.device):
            return False
        H.copy_(theirs)
        self.tokens = other.tokens
        return True

    def _update(self, rows: torch.Tensor) -> None:
        n_old, n_new = self.tokens, self.tokens + rows.shape[0]
        # H ← H · n_old/n_new + (2/n_new) · xᵀx, in one fused GEMM.
        self._H.addmm_(rows.T, rows, beta=n_old / n_new, alpha=2.0 / n_new)


class SharedInputFeed:
    """``feed(name, x)``: fold layer ``name``'s input ``x`` into its accumulator, once per
    distinct input. Layers that read one tensor (a block's q, k and v projections; gate and up)
    would each fold the same rows in with the same GEMM: a layer whose accumulator has mirrored
    the same earlier layer's on every batch so far, and is now fed that layer's very tensor
    (unmodified since), copies its state instead (``accumulator.mirror(other)``, an optional
    method: without it, or where it declines, the layer folds its input in itself). The states
    are bit-identical to feeding every layer, since equal states updated by the same operations
    on the same numbers stay equal. :meth:`next_batch` between batches."""

    def __init__(self, accumulators: Mapping[str, Any]) -> None:
        self.accumulators = accumulators
        self.source: dict[str, str | None] = {}  # layer -> the layer it mirrored on every batch
        self._fed: list[tuple[torch.Tensor, int, str]] = []  # this batch: (input, version, layer)

    def next_batch(self) -> None:
        """Forget this batch's inputs (they are not compared across batches)."""
        self._fed = []

    def __call__(self, name: str, x: torch.Tensor) -> None:
        accumulator = self.accumulators[name]
        twin = next((n for t, v, n in self._fed if t is x and t._version == v), None)
        mirror = getattr(accumulator, "mirror", None)
        if (
            twin is not None
            and self.source.get(name, twin) == twin
            and mirror is not None
            and mirror(self.accumulators[twin])
        ):
            self.source[name] = twin
            return
        accumulator.add_batch(x)
        self.source[name] = None
        self._fed.append((x, x._version, name))


def _first_tensor(value: Any) -> torch.Tensor | None:
    """The tensor a module's input or output stands for: tuple/list/ModelOutput → first item."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, Mapping):
        value = tuple(value.values())
    if isinstance(value, (tuple, list)) and value:
        return _first_tensor(value[0])
    return None


@contextlib.contextmanager
def observe(
    model: nn.Module,
    observers: Mapping[str, Observer | Sequence[Observer]],
    on: Side = "input",
) -> Iterator[None]:
    """Feed ``observers[name]`` (one observer or several) with the input or output of the module
    called ``name`` in ``model`` at every forward inside the ``with`` block.

    ``input``: the first positional argument (or the first tensor keyword argument when the
    module is called with keywords only). ``output``: the output, or its first element when it
    is a tuple or a ``ModelOutput`` (decoder blocks return ``(hidden, ...)``). Any module
    works: linears, norms, whole blocks. Hooks are removed on exit, also when the block raises;
    observe inputs and outputs at once by nesting two blocks.
    """
    if on not in ("input", "output"):
        raise ConfigError(f"observe(on={on!r}): expected 'input' or 'output'")
    named = dict(model.named_modules())
    missing = [name for name in observers if name not in named]
    if missing:
        raise ConfigError(f"no module named {missing[0]!r} in {type(model).__name__}")
    groups = {
        name: [obs] if isinstance(obs, Observer) else list(obs) for name, obs in observers.items()
    }

    def feed(name: str, value: Any) -> None:
        x = _first_tensor(value)
        if x is None:
            raise ValueError(f"observe: {name} has no tensor {on} to observe")
        for obs in groups[name]:
            obs.update(x)

    if on == "output":
        modules = {name: named[name] for name in groups}
        with forward_hooks(modules, lambda name, _mod, _inputs, output: feed(name, output)):
            yield
        return

    def feed_input(name: str, args: tuple, kwargs: dict[str, Any]) -> None:
        keyword = [v for v in kwargs.values() if isinstance(v, torch.Tensor)]
        feed(name, args[0] if args else keyword[:1])

    handles = [
        named[name].register_forward_pre_hook(
            lambda _mod, args, kwargs, _name=name: feed_input(_name, args, kwargs),
            with_kwargs=True,
        )
        for name in groups
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
