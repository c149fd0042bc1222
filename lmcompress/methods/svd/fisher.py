"""The Fisher-weighted low-rank methods: FWSVD (a diagonal Fisher, one importance per input
feature) and GFWSVD (a Kronecker-factored Fisher, both sides). Both run the core's gradient
pass (:func:`lmcompress.compressor.calibration.gradients.gradient_statistics`) over the calibration
windows
of the dense model."""

from __future__ import annotations

import logging
import time

import torch
from torch import nn
from tqdm.auto import tqdm

from lmcompress.compressor.calibration.gradients import GradientStats, gradient_statistics
from lmcompress.compressor.method import Stats
from lmcompress.compressor.model.budget import backward_bytes
from lmcompress.compressor.model.surgery import weight_matrix
from lmcompress.compressor.util.progress import bar_disabled
from lmcompress.errors import ConfigError
from lmcompress.methods.svd.config import FWSVDConfig, GFWSVDConfig
from lmcompress.methods.svd.kronecker import nearest_kronecker
from lmcompress.methods.svd.method import LowRankMethod, Weights, stat
from lmcompress.methods.svd.weighted import guard_diagonal, regularised_cholesky

logger = logging.getLogger(__name__)

IMPORTANCE = "importance"
INPUT_FACTOR, OUTPUT_FACTOR = "X", "Y"
SAMPLE_DTYPE = torch.bfloat16  # per-sample gradients kept for the nearest Kronecker product


def sample_count(windows: int, batch_size: int) -> int:
    """Backward passes (gradient samples) of ``windows`` windows, ``batch_size`` per pass."""
    return -(-max(windows, 1) // batch_size)


class SampleStore:
    """``on_sample`` of the gradient pass: every layer's per-sample gradients, in bfloat16, for
    the nearest Kronecker product.

    The buffers, one (samples, out, in) tensor per layer, are allocated before the pass: copies
    made one by one inside backward sat between its temporaries on the heap and kept them from
    being reused (RSS grew ~1 GB per 8 × 512-token sample on SmolLM2, not 0.2 GB).
    """

    def __init__(self, layers: dict[str, nn.Module], samples: int) -> None:
        self.buffers = {
            name: torch.empty(
                (samples, *weight_matrix(module).shape),
                dtype=SAMPLE_DTYPE,
                device=weight_matrix(module).device,
            )
            for name, module in layers.items()
        }
        self.count = dict.fromkeys(layers, 0)

    def __call__(self, name: str, G: torch.Tensor) -> None:
        self.buffers[name][self.count[name]].copy_(G)
        self.count[name] += 1

    def pop(self, name: str) -> torch.Tensor:
        """Layer ``name``'s samples (K, out, in), handed over and forgotten here."""
        return self.buffers.pop(name)[: self.count[name]]


def fwsvd_stats(found: dict[str, GradientStats], windows: int) -> Stats:
    """FWSVD's statistics from a gradient pass with ``fisher``: one importance per input
    feature, the Fisher summed over the output rows (FWSVD's row sums in its y = xW layout)."""
    tensors = {f"{name}.{IMPORTANCE}": layer.fisher.sum(0).cpu() for name, layer in found.items()}
    samples = next(iter(found.values())).samples
    return Stats(tensors=tensors, meta={"windows": windows, "samples": samples})


def gfwsvd_stats(
    found: dict[str, GradientStats],
    windows: int,
    samples: SampleStore | None = None,
    power_iters: int = 4,
) -> Stats:
    """GFWSVD's factors from a gradient pass with ``kronecker``: K-FAC (the means of Σxxᵀ and
    Σδδᵀ), or with the pass's per-sample gradients ``samples`` the nearest Kronecker product,
    started from K-FAC's input factor. The samples are freed layer by layer."""
    tensors = {}
    meta: dict = {"windows": windows, "kronecker": "kfac" if samples is None else "nearest"}
    start = time.perf_counter()
    iterations = []
    for name, layer in tqdm(
        found.items(), desc="gfwsvd factors", unit="layer", disable=bar_disabled()
    ):
        X = layer.xx / layer.tokens  # K-FAC, as means (and where the power iteration starts)
        if samples is None:
            Y = layer.dd / layer.tokens
        else:
            grads = samples.pop(name).float()  # (K, out, in)
            X, Y, used = nearest_kronecker(grads, init=X, iters=power_iters)
            iterations.append(used)
            del grads
        tensors[f"{name}.{INPUT_FACTOR}"] = X.cpu()
        tensors[f"{name}.{OUTPUT_FACTOR}"] = Y.cpu()
    if samples is not None:
        meta["samples"] = int(next(iter(found.values())).samples)
        meta["power_iterations"] = iterations
        meta["power_seconds"] = round(time.perf_counter() - start, 1)
    return Stats(tensors=tensors, meta=meta)


class _GradientMethod(LowRankMethod):
    needs_calibration = True

    def _gradient_pass(self, model: nn.Module, data: torch.Tensor | None, **kwargs) -> dict:
        if data is None:
            raise ConfigError(f"{self.name} needs calibration data")
        if data.shape[1] < 2:
            raise ConfigError(f"{self.name}: calibration windows need at least 2 tokens")
        layers = self.validate(model)
        device = self.device or next(model.parameters()).device
        moved = device != next(model.parameters()).device
        if moved:  # the gradient pass runs where the statistics are wanted
            original = next(model.parameters()).device
            model.to(device)
        try:
            return gradient_statistics(
                model,
                data,
                layers,
                batch_size=self.config.calib_batch_size,
                checkpointing=self.config.checkpointing,
                **kwargs,
            )
        finally:
            if moved:
                model.to(original)

    def _pass_estimate(
        self, model: nn.Module, nsamples: int, seq_len: int, itemsize: int
    ) -> dict[str, int]:
        """One batch's backward: every block's activations, or with checkpointing one block's
        and the hidden states between blocks (and the logits either way)."""
        batch = min(self.config.calib_batch_size, max(self.stats_windows(nsamples), 1))
        full = backward_bytes(model, batch, seq_len, itemsize)
        if not self.config.checkpointing:
            return {"activations kept for backward": full}
        config = model.config
        blocks_only = backward_bytes(model, batch, seq_len, itemsize, logit_copies=0)
        one_block = blocks_only // config.num_hidden_layers
        boundaries = config.num_hidden_layers * batch * seq_len * config.hidden_size * itemsize
        return {"activations kept for backward": one_block + boundaries + full - blocks_only}


class FWSVD(_GradientMethod):
    config_class = FWSVDConfig

    def memory_estimate(
        self, model: nn.Module, nsamples: int, seq_len: int, itemsize: int = 4
    ) -> dict[str, int]:
        """The backward pass of one batch and the Fisher accumulators (one per weight)."""
        layers = self.validate(model)
        parts = self._pass_estimate(model, nsamples, seq_len, itemsize)
        parts["Fisher accumulators"] = sum(4 * weight_matrix(m).numel() for m in layers.values())
        return {**parts, **self.block_pass_estimate(model, nsamples, seq_len, itemsize)}

    def calibrate(self, model: nn.Module, data: torch.Tensor | None) -> Stats:
        found = self._gradient_pass(model, data, fisher=True, kronecker=False)
        return fwsvd_stats(found, int(data.shape[0]))

    def weights(self, name: str, W: torch.Tensor, stats: Stats) -> Weights:  # noqa: ARG002
        importance = stat(stats, name, IMPORTANCE).to(W.device).double()
        return guard_diagonal(importance.sqrt()), None, {}


class GFWSVD(_GradientMethod):
    config_class = GFWSVDConfig

    def memory_estimate(
        self, model: nn.Module, nsamples: int, seq_len: int, itemsize: int = 4
    ) -> dict[str, int]:
        """The backward pass of one batch, the Kronecker accumulators, and with
        ``kronecker="nearest"`` every sample's gradient of every layer (bfloat16)."""
        layers = self.validate(model)
        parts = self._pass_estimate(model, nsamples, seq_len, itemsize)
        shapes = [weight_matrix(m).shape for m in layers.values()]
        parts["Kronecker factors"] = sum(4 * (m * m + n * n) for m, n in shapes)
        if self.config.kronecker == "nearest":
            samples = sample_count(self.stats_windows(nsamples), self.config.calib_batch_size)
            parts["per-sample gradients"] = samples * sum(2 * m * n for m, n in shapes)
        return {**parts, **self.block_pass_estimate(model, nsamples, seq_len, itemsize)}

    def calibrate(self, model: nn.Module, data: torch.Tensor | None) -> Stats:
        kept = None
        if self.config.kronecker == "nearest" and data is not None:  # (None: refused below)
            samples = sample_count(int(data.shape[0]), self.config.calib_batch_size)
            kept = SampleStore(self.select(model), samples)
        found = self._gradient_pass(model, data, fisher=False, kronecker=True, on_sample=kept)
        return gfwsvd_stats(found, int(data.shape[0]), kept, self.config.power_iters)

    def input_gram(self) -> str | None:
        """K-FAC's input factor is the inputs' Gram; the nearest product's is not."""
        return INPUT_FACTOR if self.config.kronecker == "kfac" else None

    def weights(self, name: str, W: torch.Tensor, stats: Stats) -> Weights:  # noqa: ARG002
        X = stat(stats, name, INPUT_FACTOR).to(W.device).double()
        Y = stat(stats, name, OUTPUT_FACTOR).to(W.device).double()
        L_X, alpha_x = regularised_cholesky(X, self.config.damp)
        L_Y, alpha_y = regularised_cholesky(Y, self.config.damp)
        return L_X, L_Y, {"damp_in": alpha_x, "damp_out": alpha_y}
