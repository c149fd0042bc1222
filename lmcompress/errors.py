"""Errors a user can cause and fix: the CLI prints them as one line and exits 2."""


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
