"""Every format and model transform lmcompress ships, by name: what export and load look up.

Importing this module imports each built-in format (they register themselves in
:mod:`~lmcompress.compressor.formats.registry`), so a lookup never misses one that merely was
not imported yet.
"""

from __future__ import annotations

from lmcompress.compressor.formats import (
    int4,
    int8,
    int8_softmax,
    low_rank,
    nm_packed,
    nm_packed_int8,
)
from lmcompress.compressor.formats.base import CompressedLinear, ModelTransform
from lmcompress.compressor.formats.registry import FORMATS, TRANSFORMS
from lmcompress.errors import ModelLoadError

BUILTIN = (int4, int8, int8_softmax, low_rank, nm_packed, nm_packed_int8)  # registered on import


def format_class(name: str) -> type[CompressedLinear]:
    """The class stored under ``name``; a one-line error for an unknown (foreign, newer)
    format."""
    if name not in FORMATS:
        raise ModelLoadError(
            f"unknown compressed format {name!r}; known: {', '.join(sorted(FORMATS))}"
        )
    return FORMATS[name]


def transform_class(kind: str) -> type[ModelTransform]:
    """The transform class stored under ``kind``; a one-line error for an unknown one."""
    if kind not in TRANSFORMS:
        raise ModelLoadError(
            f"unknown model transform {kind!r}; known: {', '.join(sorted(TRANSFORMS)) or 'none'}"
        )
    return TRANSFORMS[kind]
