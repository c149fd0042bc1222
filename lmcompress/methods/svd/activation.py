"""The activation-aware low-rank methods: ASVD (a per-channel input scale) and SVD-LLM
(whitening by the Cholesky factor of the inputs' Gram matrix). One forward pass over the
calibration windows of the dense model collects what both need."""

from __future__ import annotations

import logging

import torch
from torch import nn
from tqdm.auto import tqdm

from lmcompress.compressor.calibration.observers import (
    GramObserver,
    MeanAbsObserver,
    Observer,
    observe,
)
from lmcompress.compressor.method import Stats
from lmcompress.compressor.model.surgery import weight_matrix
from lmcompress.compressor.util.progress import bar_disabled
from lmcompress.errors import ConfigError
from lmcompress.methods.svd.config import ASVDConfig, SVDLLMConfig
from lmcompress.methods.svd.method import LowRankMethod, Weights, stat
from lmcompress.methods.svd.weighted import guard_diagonal, regularised_cholesky

logger = logging.getLogger(__name__)

MEAN_ABS = "mean_abs"
GRAM = "gram"


@torch.no_grad()
def forward_statistics(
    model: nn.Module,
    data: torch.Tensor,
    observers: dict[str, Observer],
    batch_size: int,
    device: torch.device,
    desc: str,
) -> None:
    """Run the model over the windows ``data`` (N, T), ``batch_size`` at a time, feeding each
    selected layer's input to its observer."""
    with observe(model, observers, on="input"):
        for start in tqdm(
            range(0, data.shape[0], batch_size), desc=desc, unit="batch", disable=bar_disabled()
        ):
            model(input_ids=data[start : start + batch_size].to(device), use_cache=False)


class _ActivationMethod(LowRankMethod):
    needs_calibration = True
    observer = Observer
    key = ""

    def memory_estimate(
        self, model: nn.Module, nsamples: int, seq_len: int, itemsize: int = 4
    ) -> dict[str, int]:
        """One batch's activations and its logits; the statistics (float32)."""
        layers = self.validate(model)
        config = model.config
        batch = min(self.config.calib_batch_size, max(self.stats_windows(nsamples), 1))
        tokens = batch * seq_len
        return {
            "calibration batch": tokens * (8 * config.hidden_size + config.vocab_size) * itemsize,
            "activation statistics": sum(
                4 * self._stat_numel(weight_matrix(m).shape[1]) for m in layers.values()
            ),
            **self.block_pass_estimate(model, nsamples, seq_len, itemsize),
        }

    def _stat_numel(self, in_features: int) -> int:
        return in_features

    def calibrate(self, model: nn.Module, data: torch.Tensor | None) -> Stats:
        if data is None:
            raise ConfigError(f"{self.name} needs calibration data")
        layers = self.validate(model)
        observers = {name: self.observer() for name in layers}
        device = self.device or next(model.parameters()).device
        forward_statistics(
            model, data, observers, self.config.calib_batch_size, device, f"{self.name} inputs"
        )
        tensors = {f"{name}.{self.key}": self.read(obs).cpu() for name, obs in observers.items()}
        return Stats(tensors=tensors, meta={"windows": int(data.shape[0])})

    def read(self, observer: Observer) -> torch.Tensor:
        raise NotImplementedError


class ASVD(_ActivationMethod):
    config_class = ASVDConfig
    observer = MeanAbsObserver
    key = MEAN_ABS

    def read(self, observer: MeanAbsObserver) -> torch.Tensor:
        return observer.mean_abs

    def weights(self, name: str, W: torch.Tensor, stats: Stats) -> Weights:  # noqa: ARG002
        scale = stat(stats, name, MEAN_ABS).to(W.device).double().pow(self.config.alpha)
        return guard_diagonal(scale), None, {}


class SVDLLM(_ActivationMethod):
    config_class = SVDLLMConfig
    observer = GramObserver
    key = GRAM

    def _stat_numel(self, in_features: int) -> int:
        return in_features**2

    def read(self, observer: GramObserver) -> torch.Tensor:
        return observer.gram / max(observer.tokens, 1)  # the mean: same factor up to scale

    def input_gram(self) -> str | None:
        return GRAM

    def weights(self, name: str, W: torch.Tensor, stats: Stats) -> Weights:  # noqa: ARG002
        gram = stat(stats, name, GRAM).to(W.device).double()
        L, alpha = regularised_cholesky(gram, self.config.damp)
        return L, None, {"damp": alpha}
