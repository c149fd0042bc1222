"""``compress-model bench``: the speed of a checkpoint and its exports, checked first like every
job (device, checkpoint, each export's manifest), written atomically if asked."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lmcompress.compressor.io.layout import MANIFEST, MODEL_CARD
from lmcompress.compressor.io.load import read_manifest
from lmcompress.compressor.io.model_card import model_card
from lmcompress.compressor.io.output import OutputDir
from lmcompress.compressor.io.speed_report import (
    SPEED_JSON,
    SPEED_MD,
    SPEED_PNG,
    plot_speed,
    speed_table,
    write_speed,
)
from lmcompress.compressor.model.checkpoint import check_checkpoint
from lmcompress.compressor.model.loading import check_device
from lmcompress.compressor.util.fsutil import atomic_file
from lmcompress.errors import ConfigError
from lmcompress.evaluation.speed import SpeedOptions, bench


def bench_job(
    checkpoint: str,
    exports: Sequence[str],
    options: SpeedOptions,
    output: str | None = None,
    threads: int | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Check every input in about a second, then :func:`~lmcompress.evaluation.speed.bench`;
    ``output``: a directory for ``speed.json``, ``speed.md`` and ``speed.png``."""
    if threads is not None and threads < 1:  # torch.set_num_threads raises a bare RuntimeError
        raise ConfigError(f"--threads must be at least 1, got {threads}")
    check_device(options.device)
    check_checkpoint(checkpoint)
    for export in exports:
        read_manifest(export)  # a one-line error for a directory that is not an output
    out = None if output is None else OutputDir(output, overwrite)
    if out is not None:
        out.check([Path(checkpoint), *map(Path, exports)])
    if threads is not None:
        torch.set_num_threads(threads)
    record = bench(checkpoint, exports, options)
    if out is not None:
        with out.build() as tmp:
            write_speed(record, tmp)
        record["output"] = output
    return record


def bench_into_export(checkpoint: str, export: str | Path, options: SpeedOptions) -> dict[str, Any]:
    """``compress-model ... --bench``: time the export just written against ``checkpoint``
    (dense fp32 and bf16), then add the record to its ``compression.json`` (``results.speed``),
    its model card (a Speed section) and ``speed.{json,md,png}`` beside them. Each file is
    replaced whole (written beside it, then renamed): an interrupted bench leaves the export as
    it was."""
    export = Path(export)
    record = bench(checkpoint, [export], options)
    manifest = json.loads((export / MANIFEST).read_text())  # as written, not upgraded
    manifest.setdefault("results", {})["speed"] = record
    with atomic_file(export / SPEED_JSON) as handle:
        handle.write(json.dumps(record, indent=2) + "\n")
    with atomic_file(export / SPEED_MD) as handle:
        handle.write(speed_table(record))
    plot = export / f".tmp-{SPEED_PNG}"
    plot_speed(record, plot)
    os.replace(plot, export / SPEED_PNG)
    with atomic_file(export / MANIFEST) as handle:
        handle.write(json.dumps(manifest, indent=2) + "\n")
    with atomic_file(export / MODEL_CARD, encoding="utf-8") as handle:
        handle.write(model_card(manifest, export.name))
    return record
