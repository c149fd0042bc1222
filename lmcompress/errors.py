"""Errors a user can cause and fix: the CLI prints them as one line and exits 2."""

import reprlib


class LmcompressError(Exception):
    """Base class for user-facing errors (bad input, bad option, unsupported model)."""


class ConfigError(LmcompressError, ValueError):
    """An option value that cannot work (impossible N:M, ratio outside (0, 1), ...)."""


class ModelLoadError(LmcompressError):
    """A checkpoint that is missing, corrupt, foreign, or of an unsupported architecture."""


class DataError(LmcompressError):
    """A corpus or calibration source that is missing, empty or unreadable."""


def first_line(err: BaseException) -> str:
    """An exception's message as one line (its type's name when it has none): what a one-line
    error quotes of the exception underneath."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _bounded_repr() -> reprlib.Repr:
    shower = reprlib.Repr()  # Python 3.11 takes no keyword arguments
    shower.maxlevel, shower.maxlist, shower.maxtuple, shower.maxdict = 3, 8, 8, 8
    shower.maxset, shower.maxfrozenset = 8, 8
    shower.maxstring = shower.maxlong = shower.maxother = MESSAGE_VALUE_CHARS
    return shower


MESSAGE_VALUE_CHARS = 80
_REPR = _bounded_repr()


def shown(value: object, limit: int = MESSAGE_VALUE_CHARS) -> str:
    """``repr(value)`` for an error message, at most ``limit`` characters: a recipe can hold a
    list of a million items or one nested a thousand times through YAML aliases, and
    :mod:`reprlib` renders only the first few items of each level instead of the whole."""
    return cut(_REPR.repr(value), limit)


def cut(text: str, limit: int = MESSAGE_VALUE_CHARS) -> str:
    """``text`` cut to ``limit`` characters, the cut marked with an ellipsis."""
    return text if len(text) <= limit else text[: limit - 1] + "…"
