"""Where formats and model transforms register: two dicts and their decorators, nothing else.

A leaf module (it imports nothing of lmcompress), so that defining a format anywhere never
creates an import cycle, as torchao keeps its transform registry. Look a name up through
:mod:`~lmcompress.compressor.formats.catalog`, which imports every built-in format first.
"""

from __future__ import annotations

from typing import Any

# format name -> CompressedLinear subclass; transform kind -> ModelTransform subclass
FORMATS: dict[str, type[Any]] = {}
TRANSFORMS: dict[str, type[Any]] = {}


def register_format(cls: type[Any]) -> type[Any]:
    """Class decorator: make ``cls`` (a ``CompressedLinear``) loadable under ``cls.format``."""
    if not cls.format:
        raise TypeError(f"{cls.__name__} has no format name")
    FORMATS[cls.format] = cls
    return cls


def register_transform(cls: type[Any]) -> type[Any]:
    """Class decorator: make ``cls`` (a ``ModelTransform``) loadable under ``cls.kind``."""
    if not cls.kind:
        raise TypeError(f"{cls.__name__} has no kind")
    TRANSFORMS[cls.kind] = cls
    return cls
