"""The offline softmax bias correction of the int8 method: estimate β = E[p − Q(p)] per
attention module (per layer, as Pandey et al. (arXiv 2309.01729); per head, ours) on the float
model. The quantization it corrects, the rule for which entries are valid, and the folded
zero-point that deploys it are in :mod:`lmcompress.compressor.formats.int8_softmax`.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from tqdm.auto import tqdm

from lmcompress.compressor.formats.int8_softmax import DEFAULT_SCALE, QMAX, check_scale
from lmcompress.compressor.model.attention import attention_hook
from lmcompress.compressor.util.progress import bar_disabled
from lmcompress.errors import ConfigError

logger = logging.getLogger(__name__)

GRANULARITIES = ("layer", "head")


def check_granularity(granularity: str) -> str:
    if granularity not in GRANULARITIES:
        raise ConfigError(
            f"unknown bias-correction granularity {granularity!r}; choose one of "
            f"{', '.join(GRANULARITIES)}"
        )
    return granularity


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
