"""Checks of a directory a job writes: it can be created or written (:func:`check_writable`),
and how a one-line message quotes its path (:func:`shown_path`). Used for the output directory
(:class:`lmcompress.compressor.io.output.OutputDir`) and the job's work directories alike.
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

from lmcompress.errors import ConfigError

PATH_SHOWN = 100  # characters of a path a message quotes whole


def shown_path(path: str | os.PathLike) -> str:
    """A path as a one-line message quotes it: whole up to :data:`PATH_SHOWN` characters,
    else its two ends and its length."""
    text = os.fspath(path)
    if len(text) <= PATH_SHOWN:
        return text
    return f"{text[:50]}…{text[-40:]} ({len(text)} characters)"


def check_writable(path: str | os.PathLike, what: str, inside: bool = True) -> Path:
    """The resolved directory ``path``, after checking that the job can create or write it:
    one-line :class:`ConfigError` s for an empty path (an unset variable), a path that is not
    valid UTF-8 (undecodable bytes in argv), a name longer than
    the filesystem allows, a symlink loop, a dangling symlink (in any component), a path under
    a file, and a place that cannot be written. ``inside``: files go into the directory (a
    work directory), else beside it (an output, built in a temporary sibling and renamed).

    Writability is probed by creating and removing a directory in the nearest existing
    ancestor (this catches ``/proc``, read-only mounts and missing permissions without
    trusting ``os.access``)."""
    text = os.fspath(path)
    if not text.strip():
        flag = "-o" if what == "output" else what
        raise ConfigError(f"{flag} is empty (an unset variable?): name the {what} directory")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # undecodable bytes of argv, as surrogates: no card, no JSON
        raw_bytes = os.fsencode(text).decode("utf-8", "backslashreplace")
        raise ConfigError(
            f"{what} {shown_path(raw_bytes)} is not valid UTF-8: the export records its path "
            "in text files; choose a UTF-8 name"
        ) from None
    shown = shown_path(text)
    raw = Path(text).expanduser().absolute()
    limit = os.pathconf("/", "PC_NAME_MAX") if hasattr(os, "pathconf") else 255
    if any(len(os.fsencode(part)) > limit for part in raw.parts):
        raise ConfigError(f"{what} {shown}: a name in it is longer than {limit} bytes")
    try:
        os.stat(raw)
    except FileNotFoundError:
        pass
    except NotADirectoryError:
        pass  # found below: which ancestor is a file
    except OSError as err:
        reason = {
            errno.ELOOP: "a symlink loop",
            errno.ENAMETOOLONG: "the path is longer than the system allows",
        }.get(err.errno, err.strerror or str(err))
        raise ConfigError(f"{what} {shown}: {reason}") from None
    ancestor = raw if inside else raw.parent
    while not ancestor.exists():
        if ancestor.is_symlink():
            raise ConfigError(
                f"{what} {shown}: {shown_path(ancestor)} is a dangling symlink (to "
                f"{shown_path(os.readlink(ancestor))}); remove it or choose another path"
            )
        ancestor = ancestor.parent
    if raw.is_symlink() and not raw.exists():
        raise ConfigError(
            f"{what} {shown} is a dangling symlink (to {shown_path(os.readlink(raw))}); "
            "remove it or choose another path"
        )
    if raw.exists() and not raw.is_dir():
        raise ConfigError(f"{what} {shown} exists and is not a directory")
    if not ancestor.is_dir():
        raise ConfigError(f"{what} {shown}: {shown_path(ancestor)} is a file, not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".lmcompress-probe-", dir=ancestor))
    except OSError as err:
        raise ConfigError(
            f"{what} {shown}: cannot write in {shown_path(ancestor)} ({err.strerror or err})"
        ) from None
    return raw.resolve()
