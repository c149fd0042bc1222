"""int8 on a Hugging Face model: every selected linear becomes a :class:`QuantLinear` (W8A8),
and optionally every attention softmax an 8-bit one with its offline bias correction.

Calibration (only when needed: static activation scales, or the softmax correction) runs the
float model over the calibration windows once, observing each selected layer's input absmax and
each attention module's ``p − Q(p)``; ``apply`` quantizes and installs the 8-bit softmax
(:class:`~lmcompress.compressor.formats.int8_softmax.Int8Softmax`), which export stores and
``load_compressed`` installs again. The softmax bias is estimated on the float model, before
the weights are quantized.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn
from tqdm.auto import tqdm

from lmcompress.compressor.calibration.observers import AbsMaxObserver, observe
from lmcompress.compressor.formats.int8 import QuantLinear
from lmcompress.compressor.formats.int8_softmax import Int8Softmax, SoftmaxQuantizer
from lmcompress.compressor.formats.quant import absmax_scale
from lmcompress.compressor.method import Method, Stats
from lmcompress.compressor.model.attention import attention_hook
from lmcompress.compressor.model.families import family_of
from lmcompress.compressor.model.surgery import replace_modules, weight_matrix
from lmcompress.compressor.report import CompressionReport, LayerReport
from lmcompress.compressor.util.progress import bar_disabled
from lmcompress.errors import ConfigError
from lmcompress.methods.common import count_params
from lmcompress.methods.int8.bias_plot import bias_magnitudes
from lmcompress.methods.int8.config import Int8Config
from lmcompress.methods.int8.smooth import check_smoothable, smooth_
from lmcompress.methods.int8.softmax import SoftmaxBiasAccumulator

logger = logging.getLogger(__name__)

ABSMAX = "input_absmax"  # Stats keys: "<layer>.input_absmax", "softmax_bias.<attention module>"
BIAS = "softmax_bias."


class Int8(Method):
    config_class = Int8Config

    composes_after = frozenset({"nm_packed", None})  # N:M or unstructured zeros stay zeros

    def stored_format(self, layer: str) -> str:  # noqa: ARG002
        return QuantLinear.format

    @property
    def needs_calibration(self) -> bool:
        """Calibration text only for static activation scales, the softmax bias correction or
        SmoothQuant; dynamic W8A8 quantizes from the weights alone."""
        config = self.config
        return (
            config.activations == "static"
            or config.bias_correction != "none"
            or config.smooth_alpha > 0
        )

    def validate(self, model: nn.Module) -> dict[str, nn.Module]:
        layers = super().validate(model)
        if self.config.head == "int8":
            # after the selection, which refuses a tied head: int8 codes are a copy, and the
            # embedding that shares the float weight keeps it
            head = family_of(model).head
            layers[head] = model.get_submodule(head)
        if self.config.smooth_alpha > 0:
            check_smoothable(model)
        group = self.config.group_size
        for name, module in layers.items():
            in_features = weight_matrix(module).shape[1]
            if group and in_features % group:
                raise ConfigError(
                    f"group_size {group} does not divide {name}'s {in_features} input features"
                )
        return layers

    def memory_estimate(
        self, model: nn.Module, nsamples: int, seq_len: int, itemsize: int = 4
    ) -> dict[str, int]:
        """The int8 copy of the weights beside the float ones while layers are swapped, and,
        when calibrating, one batch's activations and attention probabilities (eager)."""
        layers = self.validate(model)
        parts = {"int8 weights": sum(weight_matrix(m).numel() for m in layers.values())}
        if self.needs_calibration:
            config = model.config
            batch = min(self.config.calib_batch_size, max(nsamples, 1))
            heads = getattr(config, "num_attention_heads", 1)
            parts["calibration batch"] = (
                batch * seq_len * (8 * config.hidden_size + 3 * heads * seq_len) * itemsize
            )
        return parts

    @torch.no_grad()
    def calibrate(self, model: nn.Module, data: torch.Tensor | None) -> Stats:
        if not self.needs_calibration:
            return Stats()
        if data is None:
            raise ConfigError("int8 with static activations or a bias correction needs data")
        layers = self.validate(model)
        ranges = self.config.activations == "static" or self.config.smooth_alpha > 0
        # per input channel: smoothing needs them, and static ranges follow from them
        observers = {name: AbsMaxObserver(per_channel=True) for name in layers} if ranges else {}
        softmax = (
            SoftmaxBiasAccumulator(self.config.softmax_step)
            if self.config.bias_correction != "none"
            else None
        )
        device = self.device or next(model.parameters()).device
        batch_size = self.config.calib_batch_size
        with observe(model, observers, on="input"), attention_hook(model) as hook:
            if softmax is not None:
                hook.observe = lambda module, probs: softmax.add_batch(hook.name(module), probs)
            for start in tqdm(
                range(0, data.shape[0], batch_size),
                desc="int8 calibration",
                unit="batch",
                disable=bar_disabled(),
            ):
                model(input_ids=data[start : start + batch_size].to(device), use_cache=False)
        tensors = {f"{name}.{ABSMAX}": obs.absmax.float() for name, obs in observers.items()}
        if softmax is not None:
            for name, beta in softmax.bias(self.config.bias_correction).items():
                tensors[BIAS + name] = beta
        return Stats(tensors=tensors, meta={"windows": int(data.shape[0])})

    def apply(self, model: nn.Module, stats: Stats) -> CompressionReport:
        start = time.perf_counter()
        config = self.config
        layers = self.validate(model)
        report = CompressionReport(self.name, config.to_dict(), model_params=count_params(model))

        def quantize(name: str, module: nn.Module) -> QuantLinear:
            layer_start = time.perf_counter()
            input_scale = None
            if config.activations == "static":  # the input's range after smoothing
                absmax = stats.tensors[f"{name}.{ABSMAX}"].float()
                if name in factors:
                    absmax = absmax / factors[name].to(absmax.device)
                input_scale = absmax_scale(absmax.amax()).reshape(1)
            new = QuantLinear.from_linear(
                module,
                activations=config.activations,
                input_scale=input_scale,
                group_size=config.group_size or None,
                path=config.path,
            )
            W = weight_matrix(module).detach()  # (out, in)
            report.layers.append(
                LayerReport.measure(
                    name,
                    W,
                    new.dense_weight(),
                    layer_start,
                    params_kept=W.numel(),
                    # int8 codes + fp32 scales
                    bytes_compressed=new.weight_q.numel() + 4 * new.weight_scale.numel(),
                    bits=8,
                    format=QuantLinear.format,
                )
            )
            return new

        factors: dict[str, torch.Tensor] = {}
        if config.smooth_alpha > 0:
            absmax = {k.removesuffix(f".{ABSMAX}"): v for k, v in stats.tensors.items()}
            factors = smooth_(model, absmax, config.smooth_alpha)
        replace_modules(model, layers, quantize)
        if config.head == "int8":  # the head has its own codes now: the export says so
            model.config.tie_word_embeddings = False
            model.config.get_text_config().tie_word_embeddings = False
        report.extra = {
            "activations": config.activations,
            "path": config.path,
            "smoothed_layers": len(factors),
        }
        if config.softmax_bits == 8:
            bias = {k.removeprefix(BIAS): v for k, v in stats.tensors.items() if k.startswith(BIAS)}
            quantizer = SoftmaxQuantizer.from_bias(bias, config.softmax_step)
            Int8Softmax(quantizer, config.bias_correction).install(model)
            report.extra["softmax"] = {
                "bits": 8,
                "scale": config.softmax_scale,
                "bias_correction": config.bias_correction,
                "bias": bias_magnitudes(bias, config.softmax_step) if bias else None,
            }
        report.seconds = time.perf_counter() - start
        logger.info("int8: %d layers quantized (%s activations)", len(layers), config.activations)
        return report
