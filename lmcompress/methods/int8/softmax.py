"""8-bit attention probabilities and their offline bias correction.

Pandey et al., "Softmax Bias Correction for Quantized Generative Models" (arXiv 2309.01729).
The paper publishes no code and its exact formula was not available: what follows is our
reconstruction, written out so a reader can check it.

Quantization of one probability (unsigned 8 bits, round half to even as ``torch.round``)::

    q = clamp(round(p / s), 0, 255),    Q(p) = s · q,    s = 1/255 (or 1/256: p = 1 clamps to 255)

Rounding is unbiased for values spread over many steps, but most attention probabilities lie far
below one step: they round to 0, each quantized row sums to less than one, and the error
``p − Q(p)`` has a positive mean β rather than being zero-mean noise. The correction estimates

    β = E_calib[p − Q(p)]   over the valid entries (per layer: the paper; per head: ours)

and adds it on dequantization, ``p̂ = s·q + β``, which is a shifted zero-point::

    p̂ = s · (q − z'),    z' = −β / s        (valid entries; masked entries stay 0)

so deployment changes a quantization parameter and adds no compute: an integer ``P·V`` with an
asymmetric P subtracts ``z'·Σ_valid V`` exactly as it would for any zero-point.

Which entries are valid. Adding β to every entry would give masked (future) keys a weight and
make the model non-causal. The attention function hands us probabilities, not the mask, so the
rule is ``valid = p > 0`` in the softmax's output: masked keys are exactly 0 (their score is
the dtype's minimum, ``exp`` underflows), so they never get β. An unmasked key is 0 only when its
score is ~104 below the row's maximum (fp32; ~17 in fp16): it stays 0 too, in calibration and in
deployment alike, so β is the exact mean error of the entries it is added to. The tempting
``q > 0`` would skip precisely the entries that carry the bias (those rounded to 0). An integer
kernel that knows the mask agrees with this rule except on such underflowed keys.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm

from lmcompress.compressor.model.attention import AttentionHook, attention_hook
from lmcompress.compressor.util.progress import bar_disabled
from lmcompress.errors import ConfigError

logger = logging.getLogger(__name__)

QMAX = 255  # unsigned 8 bits
DEFAULT_SCALE = 1 / 255
GRANULARITIES = ("layer", "head")


def check_scale(scale: float) -> float:
    """``scale`` as a float, or a one-line :class:`ConfigError` if it is not in (0, 1]."""
    scale = float(scale)
    if not 0.0 < scale <= 1.0:  # also rejects NaN
        raise ConfigError(f"softmax scale must lie in (0, 1] (e.g. 1/255 or 1/256), got {scale}")
    return scale


def check_granularity(granularity: str) -> str:
    if granularity not in GRANULARITIES:
        raise ConfigError(
            f"unknown bias-correction granularity {granularity!r}; choose one of "
            f"{', '.join(GRANULARITIES)}"
        )
    return granularity


def quantize_probs_int(p: torch.Tensor, scale: float = DEFAULT_SCALE) -> torch.Tensor:
    """``q = clamp(round(p / s), 0, 255)`` as uint8, same shape as ``p``."""
    scale = check_scale(scale)
    return torch.round(p.float() / scale).clamp_(0, QMAX).to(torch.uint8)


def dequantize_probs(
    q: torch.Tensor,  # uint8, (B, H, Tq, Tk)
    scale: float,
    zero_point: torch.Tensor | float | None,  # broadcastable to q: () or (H, 1, 1)
    valid: torch.Tensor,  # bool, like q
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``s · (q − z')`` on valid entries, 0 elsewhere (the folded form of the correction)."""
    if zero_point is None:  # masked entries already have q = 0
        return q.to(dtype) * scale
    zero_point = torch.as_tensor(zero_point, dtype=torch.float32, device=q.device)
    p_hat = (scale * (q.float() - zero_point)).to(dtype)
    return p_hat.masked_fill(~valid, 0.0)


def quantize_probs(
    p: torch.Tensor,
    scale: float = DEFAULT_SCALE,
    offset: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """``p̂ = s · clamp(round(p / s), 0, 255)`` (+ ``offset`` where ``p > 0``), in ``p``'s dtype.

    ``offset`` is β, the explicit correction: a float, or a tensor broadcastable to ``p``
    ((H, 1, 1) for per-head offsets of (B, H, Tq, Tk) probabilities). It is added only to the
    valid entries, ``p > 0`` (see the module docstring: masked keys stay 0, so causality holds).
    """
    p_hat = quantize_probs_int(p, scale).to(p.dtype) * scale
    if offset is not None:
        offset = torch.as_tensor(offset, dtype=p.dtype, device=p.device)
        p_hat = torch.where(p > 0, p_hat + offset, p_hat)
    return p_hat


def fold_bias(bias: torch.Tensor, scale: float) -> torch.Tensor:
    """The zero-point that applies the correction: ``z' = −β / s`` (float32, β's shape)."""
    return (-bias.double() / check_scale(scale)).float()


def _per_head(value: torch.Tensor) -> torch.Tensor:
    """() stays (); (H,) becomes (H, 1, 1) to broadcast against (B, H, Tq, Tk)."""
    return value if value.dim() == 0 else value.reshape(-1, 1, 1)


@dataclass
class SoftmaxQuantizer:
    """The 8-bit softmax as an ``attention_hook`` transform, with its folded correction.

    ``zero_point`` maps an attention module's qualified name to ``z'`` (float32, () per layer or
    (H,) per head); a module without an entry is quantized uncorrected (z' = 0). Use it with
    :meth:`applied` (which binds module names), or set ``names`` (e.g. ``hook.name``) and pass the
    instance as ``transform=``.
    """

    scale: float = DEFAULT_SCALE
    zero_point: dict[str, torch.Tensor] = field(default_factory=dict)
    names: object = None  # Callable[[nn.Module], str | None], set by ``applied``

    def __post_init__(self) -> None:
        self.scale = check_scale(self.scale)
        self.zero_point = {k: torch.as_tensor(v).float() for k, v in self.zero_point.items()}

    @classmethod
    def from_bias(
        cls, bias: Mapping[str, torch.Tensor], scale: float = DEFAULT_SCALE
    ) -> SoftmaxQuantizer:
        """Fold per-layer or per-head β (:func:`estimate_bias`) into zero-points."""
        return cls(scale, {name: fold_bias(b, scale) for name, b in bias.items()})

    def quantize(self, name: str | None, probs: torch.Tensor) -> torch.Tensor:
        """Quantize (B, H, Tq, Tk) probabilities of module ``name``, dequantized in their dtype."""
        q = quantize_probs_int(probs, self.scale)
        zero_point = self.zero_point.get(name) if name is not None else None
        if zero_point is not None:
            zero_point = _per_head(zero_point.to(probs.device))
        return dequantize_probs(q, self.scale, zero_point, probs > 0, probs.dtype)

    def __call__(self, module: nn.Module, probs: torch.Tensor) -> torch.Tensor:
        name = self.names(module) if self.names is not None else None
        return self.quantize(name, probs)

    @contextlib.contextmanager
    def applied(self, model: nn.Module) -> Iterator[AttentionHook]:
        """Run ``model`` with this 8-bit softmax inside the ``with`` block."""
        with attention_hook(model) as hook:
            self.names = hook.name
            hook.transform = self
            try:
                yield hook
            finally:
                self.names = None

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """``{module name: z'}`` for safetensors; the scale goes in the manifest (``meta``)."""
        return {name: z.contiguous() for name, z in self.zero_point.items()}

    def meta(self) -> dict[str, float]:
        return {"scale": self.scale}

    @classmethod
    def from_state(
        cls, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, float]
    ) -> SoftmaxQuantizer:
        """The inverse of :meth:`state_tensors` and :meth:`meta`."""
        return cls(float(meta["scale"]), dict(tensors))


class SoftmaxBiasAccumulator:
    """Running float64 sums of ``p − Q(p)`` over valid entries, per module and head.

    Also keeps the sums per row length (the number of valid keys of a query row), so the
    dependence of β on the row length can be measured: ``length_sums[name]`` is (H, L + 1).
    """

    def __init__(self, scale: float = DEFAULT_SCALE) -> None:
        self.scale = check_scale(scale)
        self.sums: dict[str, torch.Tensor] = {}  # name -> (H,) float64
        self.counts: dict[str, torch.Tensor] = {}  # name -> (H,) float64 (valid entries)
        self.length_sums: dict[str, torch.Tensor] = {}  # name -> (H, L + 1) float64
        self.length_counts: dict[str, torch.Tensor] = {}

    def add_batch(self, name: str, probs: torch.Tensor) -> None:
        """Accumulate (B, H, Tq, Tk) probabilities of module ``name``.

        The error of an entry is below s/2, so a row's sum of errors is exact enough in float32
        (≤ Tk terms); rows are then summed in float64. Masked entries have p = q = 0: they add
        no error, and the valid count comes from ``p > 0``.
        """
        p = probs.float()
        err = torch.round(p / self.scale).clamp_(0, QMAX).mul_(self.scale).neg_().add_(p)
        h = probs.shape[1]
        row_err = err.sum(-1).transpose(0, 1).reshape(h, -1).double()  # (H, B·Tq)
        row_len = (p > 0).sum(-1).transpose(0, 1).reshape(h, -1)  # (H, B·Tq)
        width = max(probs.shape[-1] + 1, self.length_sums.get(name, torch.empty(0, 0)).shape[1])
        len_sums = torch.zeros(h, width, dtype=torch.float64, device=probs.device)
        len_counts = torch.zeros_like(len_sums)
        len_sums.scatter_add_(1, row_len, row_err)
        len_counts.scatter_add_(1, row_len, row_len.double())
        self._add(self.sums, name, row_err.sum(-1))
        self._add(self.counts, name, row_len.sum(-1).double())
        self._add(self.length_sums, name, len_sums)
        self._add(self.length_counts, name, len_counts)

    @staticmethod
    def _add(store: dict[str, torch.Tensor], name: str, value: torch.Tensor) -> None:
        value = value.cpu()
        old = store.get(name)
        if old is not None and old.shape != value.shape:  # row lengths grew: pad the old sums
            old = nn.functional.pad(old, (0, value.shape[-1] - old.shape[-1]))
        store[name] = value if old is None else old + value

    def bias(self, granularity: str = "layer") -> dict[str, torch.Tensor]:
        """β per module: () for ``"layer"``, (H,) for ``"head"``; float32."""
        check_granularity(granularity)
        out = {}
        for name, sums in self.sums.items():
            counts = self.counts[name]
            if granularity == "layer":
                sums, counts = sums.sum(), counts.sum()
            out[name] = (sums / counts.clamp(min=1)).float()
        return out

    def length_bias(self) -> dict[str, torch.Tensor]:
        """β per module, head and row length: (H, L + 1), 0 where no row had that length."""
        return {
            name: (sums / self.length_counts[name].clamp(min=1)).float()
            for name, sums in self.length_sums.items()
        }


@torch.no_grad()
def calibrate_softmax(
    model: nn.Module,
    data: torch.Tensor,  # (nsamples, seq_len) token ids
    scale: float = DEFAULT_SCALE,
    batch_size: int = 1,
    progress: bool = True,
) -> SoftmaxBiasAccumulator:
    """One pass of ``model`` over ``data`` observing every layer's float softmax output."""
    if data.dim() != 2 or data.shape[0] < 1:
        raise ConfigError(f"calibration data must be (nsamples, seq_len), got {tuple(data.shape)}")
    accumulator = SoftmaxBiasAccumulator(scale)
    device = next(model.parameters()).device
    batches = range(0, data.shape[0], batch_size)
    with attention_hook(model) as hook:
        hook.observe = lambda module, probs: accumulator.add_batch(hook.name(module), probs)
        for i in tqdm(batches, desc="softmax bias", unit="batch", disable=bar_disabled(progress)):
            model(input_ids=data[i : i + batch_size].to(device), use_cache=False)
    logger.info("softmax bias: observed %d attention modules", len(accumulator.sums))
    return accumulator


def estimate_bias(
    model: nn.Module,
    data: torch.Tensor,
    granularity: str = "layer",
    scale: float = DEFAULT_SCALE,
    batch_size: int = 1,
    progress: bool = True,
) -> dict[str, torch.Tensor]:
    """β = E[p − Q(p)] per attention module (qualified name): () per layer, (H,) per head."""
    check_granularity(granularity)
    return calibrate_softmax(model, data, scale, batch_size, progress).bias(granularity)
