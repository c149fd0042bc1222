"""The public API's argument checks: an argument of the wrong kind is one line naming it
(:class:`~lmcompress.errors.ArgumentError`), raised where the call enters lmcompress, instead
of an ``AttributeError`` from deep inside the job after the model has loaded."""

from __future__ import annotations

import os
from typing import Any

from lmcompress.errors import ArgumentError, shown


def _got(value: Any) -> str:
    if isinstance(value, (str, bytes, int, float, bool)) or value is None:
        return shown(value)
    return f"a {type(value).__name__}"


def require(name: str, value: Any, kind: type | tuple[type, ...], expected: str) -> Any:
    """``value`` if it is a ``kind``, else an :class:`ArgumentError`: "``name`` must be
    ``expected``, got ...". Returns ``value`` so that a call can check and bind at once."""
    if isinstance(value, kind) and not (isinstance(value, bool) and bool not in _kinds(kind)):
        return value
    raise ArgumentError(f"{name} must be {expected}, got {_got(value)}")


def _kinds(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def path_argument(name: str, value: Any) -> str:
    """``value`` as a path string: a non-empty ``str`` or ``os.PathLike`` (bytes paths are
    refused: the CLI and the manifests speak text), else an :class:`ArgumentError`."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise ArgumentError(f"{name} must be a path (str or os.PathLike), got {_got(value)}")
    if not value:
        raise ArgumentError(f"{name} is an empty path")
    return value


def one_or_more(name: str, value: Any, kind: type, expected: str) -> list[Any]:
    """``value`` (one ``kind``) or the items of a list/tuple of them, as a list; anything else
    (a dict, a string, a list holding something else) an :class:`ArgumentError`."""
    if isinstance(value, kind):
        return [value]
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            require(f"{name}[{index}]", item, kind, expected)
        return list(value)
    raise ArgumentError(f"{name} must be {expected} or a list of them, got {_got(value)}")
