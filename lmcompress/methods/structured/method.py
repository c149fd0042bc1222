"""One-shot structured pruning (``--method structured``): score the structures, keep the best of
each block at the allocated width (and the span of blocks whose removal changes the hidden
states least), then extract a smaller model of the same architecture
(``compressor.model.structure.extract_``)."""

from __future__ import annotations

import time

import torch
from torch import nn

from lmcompress.compressor.method import Method, Stats
from lmcompress.compressor.model.budget import backward_bytes
from lmcompress.compressor.model.families import decoder_blocks, family_of
from lmcompress.compressor.model.structure import block_shapes, extract_, structures_of
from lmcompress.compressor.model.surgery import weight_matrix
from lmcompress.compressor.report import CompressionReport, LayerReport
from lmcompress.errors import ConfigError
from lmcompress.methods.common import count_params
from lmcompress.methods.structured.config import StructuredConfig
from lmcompress.methods.structured.distill import distill_kept
from lmcompress.methods.structured.scores import (
    allocate,
    calibration_pass,
    kept_params,
    width_scores,
)


def top_keep(scores: torch.Tensor, removed: int) -> torch.Tensor:
    """Bool (blocks, count): in each row, all but the ``removed`` lowest scores (ties: the
    earlier index is kept)."""
    kept = scores.shape[1] - removed
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :kept]
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(1, order, True)


def global_keep(
    scores: torch.Tensor, removed: int, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """Bool (blocks, count): the scores of the blocks ``rows`` (bool (blocks,); default all)
    ranked together and their ``removed · len(rows)`` lowest dropped, so that each block has its
    own width at the same total as :func:`top_keep`'s; every block keeps its best (ties: the
    earlier index is kept). The other blocks keep :func:`top_keep`'s."""
    keep = top_keep(scores, removed)
    rows = torch.ones(scores.shape[0], dtype=torch.bool) if rows is None else rows
    chosen = scores[rows].float().clone()
    chosen[torch.arange(chosen.shape[0]), chosen.argmax(dim=1)] = float("inf")
    drop = torch.sort(chosen.flatten(), stable=True).indices[: removed * chosen.shape[0]]
    kept = torch.ones(chosen.numel(), dtype=torch.bool)
    kept[drop] = False
    keep[rows] = kept.view(chosen.shape)
    return keep


def span_keep(distances: torch.Tensor | None, blocks: int, removed: int) -> torch.Tensor:
    """Bool (blocks,): every block but the ``removed`` consecutive ones from the start with the
    smallest angular distance across them (the first on a tie)."""
    keep = torch.ones(blocks, dtype=torch.bool)
    if removed:
        start = int(torch.argmin(distances))
        keep[start : start + removed] = False
    return keep


def one_shot_keep(
    model: nn.Module,
    data: torch.Tensor | None,
    kinds: tuple[str, ...],
    ratio: float,
    score: str,
    batch_size: int,
    channel_multiple: int = 1,
) -> tuple[dict[str, torch.Tensor], dict[str, int], torch.Tensor | None]:
    """``(keep, removal, distances)`` of one-shot structured pruning at ``ratio`` kept: each
    block's highest-scoring widths (``score``: activation or magnitude) and, for ``layers``, the
    span of blocks with the smallest angular distance; the calibration pass over ``data``
    where the score or the blocks need it (``distances``: ``None`` without); the kept channels
    a multiple of ``channel_multiple`` (``scores.allocate``)."""
    structures = structures_of(model, kinds)
    shapes = block_shapes(model)
    removal = allocate(shapes, kinds, ratio, channel_multiple=channel_multiple)
    norms = distances = None
    if score == "activation" or "layers" in kinds:
        span = removal.get("layers", 0)
        norms, distances = calibration_pass(model, data, structures, kinds, span, batch_size)
    weighted = norms if score == "activation" else None
    keep = {
        kind: top_keep(scores, removal[kind])
        for kind, scores in width_scores(model, structures, kinds, weighted).items()
    }
    if "layers" in kinds:
        keep["layers"] = span_keep(distances, len(shapes), removal["layers"])
    return keep, removal, distances


class Structured(Method):
    config_class = StructuredConfig
    stats_in_output = False

    @property
    def needs_calibration(self) -> bool:
        return self.config.score == "activation" or "layers" in self.config.structure

    def validate(self, model: nn.Module) -> dict[str, nn.Module]:
        """The decoder's linears; a :class:`ConfigError` for a structure the family lacks or a
        budget that removes every structure of a kind."""
        structures_of(model, self.config.structure)
        config = self.config
        allocate(block_shapes(model), config.structure, config.ratio,
                 channel_multiple=config.channel_multiple)  # fmt: skip
        return self.select(model)  # every decoder linear: no --include / --exclude here

    def memory_estimate(
        self,
        model: nn.Module,
        nsamples: int,  # noqa: ARG002
        seq_len: int,
        itemsize: int = 4,
    ) -> dict[str, int]:
        """Distillation only: the activations kept for backward (one window a step) and the
        fp32 deltas of the decoder's weights with their gradients and AdamW moments."""
        if not self.config.distill_steps:
            return {}
        numel = sum(weight_matrix(m).numel() for m in self.validate(model).values())
        return {
            "activations kept for backward": backward_bytes(model, 1, seq_len, itemsize, 3),
            "distillation deltas, gradients and moments": 4 * 4 * numel,
        }

    def calibrate(self, model: nn.Module, data: torch.Tensor | None) -> Stats:
        """Score, choose what each block keeps (``<kind>.keep`` bool tensors) and, with
        ``distill_steps``, distil the gated model; :meth:`apply` extracts."""
        start = time.perf_counter()
        layers = self.validate(model)
        config = self.config
        if (self.needs_calibration or config.distill_steps) and data is None:
            raise ConfigError("structured pruning needs calibration text for these options")
        keep, removal, distances = one_shot_keep(
            model, data, config.structure, config.ratio, config.score, config.calib_batch_size,
            config.channel_multiple,
        )  # fmt: skip
        meta = {"removal": removal}
        if config.distill_steps:
            meta["distill_history"] = distill_kept(
                model, data, layers, keep, {}, config.distill_steps, config.distill_lr
            )
        meta["seconds"] = time.perf_counter() - start
        tensors = {f"{kind}.keep": value for kind, value in keep.items()}
        if distances is not None:
            tensors["layers.distances"] = distances
        return Stats(tensors=tensors, meta=meta)

    def apply(self, model: nn.Module, stats: Stats) -> CompressionReport:
        """Extract what ``stats`` keeps (works on a fresh model too: then undistilled)."""
        start = time.perf_counter()
        self.validate(model)
        keep = {k: stats.tensors[f"{k}.keep"] for k in self.config.structure}
        report = extract_report(self, model, keep, None, stats, start)
        report.seconds += stats.meta.get("seconds", 0.0)
        return report


def extract_report(
    method: Method,
    model: nn.Module,
    keep: dict[str, torch.Tensor],
    scales: dict[str, torch.Tensor] | None,
    stats: Stats,
    started: float,
    uniform: bool = True,
) -> CompressionReport:
    """Extract ``keep`` from ``model`` (``scales`` folded in; ``uniform=False``: per-layer
    widths) and report it: a layer report per linear of the original decoder, the new sizes
    and the kept parameters in ``extra``."""
    report = CompressionReport(
        method.name, method.config.to_dict(), model_params=count_params(model)
    )
    shape, blocks = block_shapes(model)[0], len(decoder_blocks(model))
    before = {n: weight_matrix(m).detach() for n, m in method.select(model).items()}
    old_blocks = list(decoder_blocks(model))
    sizes = extract_(model, keep, scales, uniform)
    kept_blocks = {id(b) for b in decoder_blocks(model)}
    report.layers = _layer_reports(model, before, old_blocks, kept_blocks, started)
    removal = stats.meta["removal"]
    decoder, kept = blocks * shape.params, kept_params(shape, blocks, removal)
    report.extra = {
        "sizes": sizes,
        "removal": removal,
        "decoder_params": decoder,
        "decoder_params_kept": kept,
        "kept_fraction": kept / decoder,
    }
    if "layers" in keep:
        report.extra["blocks_removed"] = (~keep["layers"]).nonzero().squeeze(1).tolist()
    if "distill_history" in stats.meta:
        report.extra["distill_history"] = stats.meta["distill_history"]
    report.seconds = time.perf_counter() - started
    return report


def _layer_reports(model, before, old_blocks, kept_blocks, started) -> list[LayerReport]:
    """A report per linear of the original decoder: its parameters before and after (0 in a
    removed block); no stored format (the smaller dense weight is the stored form)."""
    prefix = family_of(model).blocks
    reports = []
    for name, weight in before.items():
        index, _, path = name.removeprefix(prefix + ".").partition(".")
        block = old_blocks[int(index)]
        after = weight_matrix(block.get_submodule(path)) if id(block) in kept_blocks else None
        kept = 0 if after is None else after.numel()
        reports.append(
            LayerReport(
                name=name,
                shape=tuple(weight.shape),
                params=weight.numel(),
                params_kept=kept,
                bytes_dense=weight.numel() * weight.element_size(),
                bytes_compressed=kept * weight.element_size(),
                sparsity=1.0 - kept / weight.numel(),
                pattern="structured",
                seconds=time.perf_counter() - started,
            )
        )
    return reports
