"""Errors a user can cause and fix: the CLI prints them as one line and exits 2."""

import re
import reprlib


class LmcompressError(Exception):
    """Base class for user-facing errors (bad input, bad option, unsupported model)."""


class ConfigError(LmcompressError, ValueError):
    """An option value that cannot work (impossible N:M, ratio outside (0, 1), ...)."""


class ArgumentError(ConfigError, TypeError):
    """A Python API argument of the wrong kind (a dict where a config goes, ``None`` where a
    path goes): one line naming the argument, caught as a :class:`ConfigError` or a
    ``TypeError``."""


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


# What must not reach a terminal as it is: C0 and C1 controls (a newline splits a one-line error,
# ESC starts an ANSI sequence that recolours or rewrites the screen), DEL, the bidirectional
# overrides that reorder what is shown, and lone surrogates (a path's bytes that are not UTF-8,
# which ``print`` cannot even encode).
_UNPRINTABLE = re.compile(
    "[\x00-\x1f\x7f-\x9f\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]"
)


def _escaped(match: re.Match[str]) -> str:
    code = ord(match.group())
    if 0xDC80 <= code <= 0xDCFF:  # a byte that was not UTF-8, as os.fsdecode keeps it
        return f"\\x{code - 0xDC00:02x}"
    return match.group().encode("unicode_escape").decode("ascii")


def printable(text: object) -> str:
    """``str(text)`` safe to write on one terminal line: every character of
    :data:`_UNPRINTABLE` written as Python escapes it (``\\n``, ``\\x1b``, ``\\u202e``; an
    undecodable byte as ``\\xff``). A path named by a user reaches the screen through an error,
    a log line or the end summary: each goes through this."""
    return _UNPRINTABLE.sub(_escaped, str(text))
