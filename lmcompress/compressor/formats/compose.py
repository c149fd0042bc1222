"""Several compression stages on one model: which layers a later stage may touch, and how the
stages' results become one stored form per layer.

A later stage sees the model as the earlier ones left it. A layer an earlier stage compressed
is left alone by a later one, unless the later one keeps what the earlier did: quantizing an
N:M-pruned weight rounds its zeros to zero codes, so int8 after 2:4 pruning is int8 codes that
are still 2:4 sparse. :data:`COMPOSED_FORMATS` lists the pairs of formats that compose and the
format the composition is stored in; a layer replaced by a compressed module (low rank, int8)
is no longer a linear layer, so no later stage selects it in any case.

:func:`compose_` turns the per-stage reports into one report (the export's) and puts each
composed layer into the model in its composed format (``nm_packed_int8``), so that
``save_compressed`` stores it as any other compressed module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from lmcompress.compressor.formats.base import CompressedLinear
from lmcompress.compressor.formats.catalog import format_class
from lmcompress.compressor.model.surgery import replace_module
from lmcompress.compressor.report import CompressionReport, LayerReport
from lmcompress.errors import ConfigError

# (earlier layer's format, later layer's format) -> the stored format. ``None`` as the earlier
# format: unstructured zeros in the dense weight, which any int8 code keeps (stored as int8).
COMPOSED_FORMATS: dict[tuple[str | None, str], str] = {
    ("nm_packed", "int8"): "nm_packed_int8",
    (None, "int8"): "int8",
    ("nm_packed", "int4"): "nm_packed_int4",
    (None, "int4"): "int4",
}


def compressed_layers(report: CompressionReport) -> dict[str, LayerReport]:
    """The layers ``report``'s stage changed: stored in a format, or pruned in place. A layer
    the stage left dense (a low-rank factorisation that would not pay) is not among them."""
    return {
        layer.name: layer
        for layer in report.layers
        if layer.format is not None or (layer.sparsity or 0) > 0
    }


def layers_to_skip(earlier: Sequence[CompressionReport], keeps: Iterable[str | None]) -> list[str]:
    """The layers a later stage must leave alone: those an earlier stage compressed, except the
    ones whose format (``None``: unstructured zeros) is in ``keeps``, the earlier formats the
    later stage composes with. A layer that two stages changed already is skipped too."""
    keeps = set(keeps)
    seen: dict[str, list[LayerReport]] = {}
    for report in earlier:
        for name, layer in compressed_layers(report).items():
            seen.setdefault(name, []).append(layer)
    return [
        name for name, layers in seen.items() if len(layers) > 1 or layers[0].format not in keeps
    ]


def composed_format(earlier: str | None, later: str | None) -> str:
    """The stored format of a layer compressed by two stages; a :class:`ConfigError` for a
    pair that does not compose."""
    if later is None or (earlier, later) not in COMPOSED_FORMATS:
        raise ConfigError(
            f"formats {earlier or 'unstructured'} then {later or 'unstructured'} do not compose"
        )
    return COMPOSED_FORMATS[(earlier, later)]


def _stored_bytes(module: CompressedLinear) -> int:
    return sum(
        t.untyped_storage().nbytes() for k, t in module.state_tensors().items() if k != "bias"
    )


@torch.no_grad()
def compose_(model: nn.Module, reports: Sequence[CompressionReport]) -> CompressionReport:
    """One report for the stages' ``reports`` (in stage order), with every layer two stages
    compressed put into ``model`` in its composed format (in place).

    The combined report has one entry per layer: a layer one stage compressed keeps that
    stage's entry; a composed one takes the first stage's weights counts (parameters kept,
    sparsity, pattern), the later stage's bits and error (measured against the earlier stage's
    weight), and the composed format with its stored bytes."""
    if not reports:
        raise ValueError("compose_ needs at least one stage report")
    per_layer: dict[str, list[LayerReport]] = {}
    for report in reports:
        for layer in report.layers:
            per_layer.setdefault(layer.name, []).append(layer)
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    merged = []
    for name in sorted(per_layer, key=lambda n: order.get(n, len(order))):
        changed = [layer for layer in per_layer[name] if layer.format or (layer.sparsity or 0) > 0]
        if len(changed) < 2:
            merged.append(changed[0] if changed else per_layer[name][-1])
            continue
        if len(changed) > 2:
            raise ConfigError(f"{name} was compressed by {len(changed)} stages; at most 2 compose")
        merged.append(_compose_layer(model, changed[0], changed[1]))
    first = reports[0]
    return CompressionReport(
        method="+".join(report.method for report in reports),
        config={"stages": [report.config for report in reports]},
        layers=merged,
        seconds=sum(report.seconds for report in reports),
        model_params=first.model_params,
        extra={"stages": [report.method for report in reports]},
    )


def _compose_layer(model: nn.Module, earlier: LayerReport, later: LayerReport) -> LayerReport:
    fmt = composed_format(earlier.format, later.format)
    options = {**later.format_options, **earlier.format_options}
    module = model.get_submodule(later.name)
    stored = later.bytes_compressed
    if fmt != later.format:
        cls = format_class(fmt)
        if isinstance(module, CompressedLinear):  # the later stage's module, re-stored
            new = cls.compose(module, **earlier.format_options)
            replace_module(model, later.name, new)
            stored = _stored_bytes(new)
        else:  # still a plain linear: export encodes it from the report's format
            stored = _stored_bytes(cls.from_linear(module, **options))
    return dataclasses.replace(
        later,
        params=earlier.params,
        params_kept=min(earlier.params_kept, later.params_kept),
        bytes_dense=earlier.bytes_dense,
        bytes_compressed=stored,
        sparsity=earlier.sparsity,
        pattern=earlier.pattern,
        rank=earlier.rank if earlier.rank is not None else later.rank,
        seconds=earlier.seconds + later.seconds,
        format=fmt,
        format_options=options,
        extra={
            **later.extra,
            "stages": [earlier.format or "unstructured", later.format],
            "rel_error_by_stage": [earlier.rel_error, later.rel_error],
        },
    )
