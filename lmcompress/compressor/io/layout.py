"""The on-disk layout of an lmcompress output directory: file names and the format version.

Shared by the writer (:mod:`~lmcompress.compressor.io.save`), the readers
(:mod:`~lmcompress.compressor.io.load`, :mod:`~lmcompress.compressor.io.hf_quantizer`) and
whoever reports on a directory (:func:`output_sizes`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FORMAT_VERSION = 2  # 2: compressed_layers[name] = {"format", "meta", "tensors"}; 1: nm_packed only
READABLE_VERSIONS = (1, 2)
MANIFEST = "compression.json"
COMPRESSED_TENSORS = "compressed.safetensors"
DENSE_TENSORS = "model.safetensors"
STATS = "stats.safetensors"
MODEL_CARD = "README.md"
REPORT_PNG = "report.png"
# A compact export (no dense copy): what config.json's transformers_weights names
WEIGHTS_INDEX = "lmcompress.safetensors.index.json"
TRANSFORMS_PREFIX = "transforms."  # key prefix of the transforms' tensors in COMPRESSED_TENSORS
QUANT_METHOD = "lmcompress"  # quantization_config.quant_method of a compact export


def update_config_json(out_dir: Path, **fields: Any) -> None:
    """Set ``fields`` in ``out_dir/config.json`` (``dtype``: the dtype the weights are stored
    in, which ``save_pretrained`` records as the model's, not ours)."""
    config_file = out_dir / "config.json"
    config = json.loads(config_file.read_text())
    config.update(fields)
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def output_sizes(out: str | Path) -> dict[str, int]:
    """Bytes of an output directory: ``total``, ``compressed`` (:data:`COMPRESSED_TENSORS`),
    ``stats`` (:data:`STATS`: a learned method's statistics, not part of the model) and
    ``dense`` (every other ``*.safetensors``: the dense copy, or the uncompressed layers)."""
    out = Path(out)

    def size(paths) -> int:
        return sum(p.stat().st_size for p in paths if p.is_file())

    return {
        "total": size(out.rglob("*")),
        "compressed": size([out / COMPRESSED_TENSORS]),
        "stats": size([out / STATS]),
        "dense": size(
            p for p in out.glob("*.safetensors") if p.name not in (COMPRESSED_TENSORS, STATS)
        ),
    }
