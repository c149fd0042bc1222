"""``compress-model bench``: the speed of a checkpoint and its exports, checked first like every
job (device, checkpoint, each export's manifest), written atomically if asked."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lmcompress.compressor.io.load import read_manifest
from lmcompress.compressor.model.checkpoint import check_checkpoint
from lmcompress.compressor.model.loading import check_device
from lmcompress.compressor.util.fsutil import atomic_dir
from lmcompress.evaluation.speed import SpeedOptions, bench
from lmcompress.evaluation.speed_report import write_speed
from lmcompress.jobs.preflight import check_output


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
    check_device(options.device)
    check_checkpoint(checkpoint)
    for export in exports:
        read_manifest(export)  # a one-line error for a directory that is not an output
    if output is not None:
        check_output(output, overwrite, [Path(checkpoint), *map(Path, exports)])
    if threads is not None:
        torch.set_num_threads(threads)
    record = bench(checkpoint, exports, options)
    if output is not None:
        with atomic_dir(Path(output)) as tmp:
            write_speed(record, tmp)
        record["output"] = output
    return record
