"""``rtn`` and ``gptq`` on a Hugging Face model: every selected linear becomes an
:class:`~lmcompress.compressor.formats.int4.Int4Linear` (``int4``), or with N:M pruning a
:class:`~lmcompress.compressor.formats.int4.PackedNMInt4Linear` (``nm_packed_int4``).

RTN reads no calibration text (and streams block by block as magnitude pruning does); GPTQ
collects each layer's Hessian through the layer-wise loop as SparseGPT does (``--streaming``
included), quantizes the layer with :func:`~lmcompress.methods.gptq.solver.gptq_quantize` and
puts the packed module in its place, so that the next block calibrates on the quantized one.
"""

from __future__ import annotations

import math
import time

import torch
from torch import nn

from lmcompress.compressor.formats.base import CompressedLinear
from lmcompress.compressor.formats.int4 import Int4Linear, PackedNMInt4Linear
from lmcompress.compressor.method import Method, Stats
from lmcompress.compressor.model.budget import backward_bytes
from lmcompress.compressor.model.families import family_of
from lmcompress.compressor.model.surgery import replace_module, weight_matrix
from lmcompress.compressor.report import CompressionReport, LayerReport
from lmcompress.errors import ConfigError
from lmcompress.methods.gptq.config import GPTQConfig, RTNConfig
from lmcompress.methods.gptq.solver import check_options, gptq_quantize
from lmcompress.methods.gptq.tuning import distill_scales
from lmcompress.methods.layerwise import LayerwiseMethod, OneShotMethod
from lmcompress.methods.obs import HessianStatistic, output_error

UNSTRUCTURED_OR_NM = frozenset({"nm_packed", None})


def grid_options(config: RTNConfig) -> dict:
    """The grid options ``Int4Linear.from_linear`` / ``from_codes`` take."""
    return {"bits": config.bits, "group_size": config.group_size, "symmetric": config.sym}


def layer_report(
    name: str,
    W: torch.Tensor,
    new: CompressedLinear,
    started: float,
    kept: int | None = None,
    **fields,
) -> LayerReport:
    """The report of a layer of weight ``W`` (out, in) now ``new`` (an int4 format): the
    ``kept`` weights (default: all) and the stored bytes of its codes, scales and zero
    points."""
    stored = sum(t.nbytes for k, t in new.state_tensors().items() if k != "bias")
    kept = W.numel() if kept is None else kept
    options = {**grid_options_of(new), **fields.pop("format_options", {})}
    return LayerReport.measure(
        name, W, new.dense_weight(), started, params_kept=kept, bytes_compressed=stored,
        bits=new.bits, format=new.format, format_options=options, **fields,
    )  # fmt: skip


def head_layer(config: RTNConfig, model: nn.Module) -> dict[str, nn.Module]:
    """``{name: module}`` of the output head when ``--head quantized``, else empty."""
    if config.head != "quantized":
        return {}
    head = family_of(model).head
    return {head: model.get_submodule(head)}


def untie_head(model: nn.Module) -> None:
    """The head has codes of its own now (the embedding keeps the float weight): the export
    must not tie them again."""
    model.config.tie_word_embeddings = False
    model.config.get_text_config().tie_word_embeddings = False


def round_to_nearest(config: RTNConfig, model: nn.Module, name: str, module: nn.Module):
    """Layer ``name`` replaced by its round-to-nearest :class:`Int4Linear`; its report."""
    start = time.perf_counter()
    half = config.scale_dtype == "float16"
    mse = config.observer == "mse"
    new = Int4Linear.from_linear(module, **grid_options(config), half_scales=half, mse=mse)
    replace_module(model, name, new)
    return layer_report(name, weight_matrix(module).detach(), new, start)


def grid_options_of(layer: CompressedLinear) -> dict:
    return {"bits": layer.bits, "group_size": layer.group_size, "symmetric": layer.symmetric}


def check_layers(config: RTNConfig, layers: dict[str, nn.Module]) -> None:
    """Every selected layer's width fits the options (group size, N:M): one line otherwise,
    naming a group size that fits every layer (SmolLM2-135M's 576: 64, not 128)."""
    widths = {name: weight_matrix(module).shape[1] for name, module in layers.items()}
    size, common = config.group_size, math.gcd(*widths.values())
    if size > 0 and common % size:
        name = next(n for n, width in widths.items() if width % size)
        fits = next((d for d in (256, 128, 64, 32, 16, 8) if d < size and common % d == 0), None)
        hint = f"; {fits} divides every selected layer" if fits else ""
        raise ConfigError(
            f"group_size {size} does not divide {name}'s {widths[name]} input columns (-1: one "
            f"group per output row{hint})"
        )
    pattern = getattr(config, "pattern", None)
    for name, module in layers.items():
        shape = tuple(weight_matrix(module).shape)
        check_options(shape, config.bits, config.group_size, getattr(config, "act_order", False),
                      pattern, getattr(config, "keep_mask", False), where=name)  # fmt: skip


class RTN(OneShotMethod, Method):
    config_class = RTNConfig
    needs_calibration = False
    streams = True
    composes_after = UNSTRUCTURED_OR_NM  # 0 is on every grid: zeros stay zeros

    def stored_format(self, layer: str) -> str:  # noqa: ARG002
        return Int4Linear.format

    def validate(self, model: nn.Module) -> dict[str, nn.Module]:
        layers = {**super().validate(model), **head_layer(self.config, model)}
        check_layers(self.config, layers)
        return layers

    def compress_layer(self, model: nn.Module, name: str, module: nn.Module) -> LayerReport:
        return round_to_nearest(self.config, model, name, module)

    def apply(self, model: nn.Module, stats: Stats) -> CompressionReport:
        report = super().apply(model, stats)
        if self.config.head == "quantized":
            untie_head(model)
        return report


class GPTQ(HessianStatistic, LayerwiseMethod):
    """GPTQ through the layer-wise loop; with ``distill_steps``, the scales then trained end
    to end (:mod:`~lmcompress.methods.gptq.tuning`) while the dense modules GPTQ replaced are
    kept (``self.dense``) for the teacher."""

    config_class = GPTQConfig

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.dense: dict[str, nn.Module] = {}

    @property
    def composes_after(self) -> frozenset[str | None]:
        """After a pruning stage only when it keeps that stage's zeros (``keep_mask``)."""
        return UNSTRUCTURED_OR_NM if self.config.keep_mask else frozenset()

    def stored_format(self, layer: str) -> str:  # noqa: ARG002
        pattern = self.config.pattern
        nm = pattern is not None and pattern.is_nm
        return PackedNMInt4Linear.format if nm else Int4Linear.format

    def validate(self, model: nn.Module) -> dict[str, nn.Module]:
        """The decoder's layers (the head, with ``--head quantized``, is rounded to nearest
        after the layer-wise loop, which ends at the last block: checked here too)."""
        layers = super().validate(model)
        check_layers(self.config, {**layers, **head_layer(self.config, model)})
        return layers

    def memory_estimate(
        self, model: nn.Module, nsamples: int, seq_len: int, itemsize: int = 4
    ) -> dict[str, int]:
        """The layer-wise loop's; ``distill_steps`` adds the dense weights kept beside the
        codes, the scales' training state and one window's activations for backward."""
        parts = super().memory_estimate(model, nsamples, seq_len, itemsize)
        if self.config.distill_steps > 0:
            numel = sum(weight_matrix(m).numel() for m in self.validate(model).values())
            parts["dense weights and the codes as bfloat16"] = (itemsize + 2) * numel
            parts["activations kept for backward"] = backward_bytes(model, 1, seq_len, itemsize, 3)
        return parts

    def compress(self, model: nn.Module, data: torch.Tensor | None = None, source=None,
                 offload_dir=None) -> tuple[CompressionReport, Stats]:  # fmt: skip
        """GPTQ, then with ``distill_steps`` the scales trained end to end (every window of
        ``data``; the layers' reports are GPTQ's, before the training)."""
        config = self.config
        if not config.distill_steps:
            return super().compress(model, data, source, offload_dir)
        if source is not None:
            raise ConfigError(
                "gptq --distill-steps trains the whole model's scales: it cannot stream"
            )
        self.dense = {}
        try:
            report, stats = super().compress(model, data)
            start = time.perf_counter()
            half = config.scale_dtype == "float16"
            history = distill_scales(
                model, data, self.dense, config.distill_steps, config.distill_lr, half
            )
        finally:
            self.dense = {}
        report.extra["distill_history"] = history
        report.seconds += time.perf_counter() - start
        return report, stats

    def apply(self, model: nn.Module, stats: Stats) -> CompressionReport:
        report = super().apply(model, stats)
        for name, module in head_layer(self.config, model).items():
            report.layers.append(round_to_nearest(self.config, model, name, module))
            untie_head(model)
        return report

    def compress_layer(
        self, model: nn.Module, name: str, module: nn.Module, statistic: torch.Tensor
    ) -> LayerReport:
        start = time.perf_counter()
        config, pattern = self.config, self.config.pattern
        W = weight_matrix(module).detach()  # (out, in)
        result = gptq_quantize(
            W, statistic, config.bits, config.group_size, config.sym, config.act_order,
            config.blocksize, config.percdamp, sparsity=pattern,
            mask=(W != 0) if config.keep_mask else None,
            half_scales=config.scale_dtype == "float16", mse=config.observer == "mse",
        )  # fmt: skip
        new = Int4Linear.from_codes(
            result.codes, result.scales, result.zeros, module, **grid_options(config)
        )
        fields = {}
        if result.keep is not None:
            kept = int(result.keep.sum())
            fields = {"kept": kept, "sparsity": 1 - kept / W.numel()}
        if pattern is not None and pattern.is_nm:
            new = PackedNMInt4Linear.from_int4(new, pattern.n, pattern.m)
            fields["format_options"] = {"n": pattern.n, "m": pattern.m}
        if pattern is not None:
            fields["pattern"] = str(pattern)
        replace_module(model, name, new)
        if config.distill_steps:  # the teacher's weight, for distill_scales
            self.dense[name] = module
        report = layer_report(name, W, new, start, **fields)
        report.rel_error, report.error_kind = output_error(W, result.weight(), statistic), "output"
        return report
