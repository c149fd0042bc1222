"""One writer per output path, nested paths included: while a job writes ``a/b``, a job naming
``a/b``, ``a`` or ``a/b/c`` is refused in one line naming the first.

The lock of a path is ``flock`` on a file in a registry directory outside every output
(:func:`registry`), named by a hash of the resolved path, so that no output directory holds a
lock (an ``--overwrite`` of ``a`` cannot delete the lock of a job writing ``a/b``). A job
writing ``P`` holds ``P``'s lock exclusively and the lock of every ancestor of ``P`` shared:

- a job on ``P`` again wants ``P`` exclusively: refused by the first's exclusive lock;
- a job on an ancestor ``A`` wants ``A`` exclusively: refused by the shared locks below it;
- a job on a descendant ``D`` wants ``P`` shared (an ancestor of ``D``): refused by the
  exclusive lock; two jobs on siblings ``a/b`` and ``a/c`` share ``a``'s lock and both run.

The kernel releases a ``flock`` when its holder dies (SIGKILL included): a killed job never
blocks the next. Every lock is taken non-blocking; a job that cannot take them all releases
those it took and is refused. The exclusive holder writes its pid, host, start time and path
into its file, for the message of the job it refuses.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from lmcompress.errors import ConfigError

BUSY = (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK)


def registry() -> Path:
    """The lock files' directory: ``$LMCOMPRESS_LOCKS``, else ``lmcompress-locks-UID`` in the
    temporary directory (per user and machine, as the locks are); made private, and refused
    if someone else owns it."""
    override = os.environ.get("LMCOMPRESS_LOCKS")
    name = f"lmcompress-locks-{os.getuid()}"
    path = Path(override).expanduser() if override else Path(tempfile.gettempdir()) / name
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(
            f"cannot make the lock directory {path} ({err.strerror or err}): set "
            "$LMCOMPRESS_LOCKS to a directory this user can write"
        ) from None
    if path.stat().st_uid != os.getuid():
        raise ConfigError(f"the lock directory {path} belongs to another user; remove it")
    return path


def lock_path(target: str | Path) -> Path:
    """The lock file of the output ``target`` (its resolved path) in the :func:`registry`."""
    key = os.fsencode(Path(target).expanduser().resolve())
    return registry() / f"{hashlib.sha256(key).hexdigest()[:32]}.lock"


@contextlib.contextmanager
def output_lock(target: str | Path) -> Iterator[None]:
    """Hold ``target``'s lock exclusively and its ancestors' shared for the ``with`` block
    (module doc); a :class:`ConfigError` naming the running job whose output is ``target``,
    inside it or around it."""
    target = Path(target).expanduser().resolve()
    held: list[tuple[Path, object]] = []
    try:
        held.append((lock_path(target), _take(target, target, exclusive=True)))
        for ancestor in target.parents:
            held.append((lock_path(ancestor), _take(ancestor, target, exclusive=False)))
        yield
    finally:
        for path, handle in reversed(held):
            _release(path, handle)


def _take(path: Path, target: Path, exclusive: bool):
    """An open lock file of ``path``, locked; a :class:`ConfigError` if another job holds it."""
    file = lock_path(path)
    while True:
        handle = open(file, "a+")  # noqa: SIM115 (held for the job: closed by _release)
        try:
            fcntl.flock(handle, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        except OSError as err:
            handle.close()
            if err.errno not in BUSY:
                raise
            raise _refusal(file, path, target) from None
        try:
            same = os.fstat(handle.fileno()).st_ino == os.stat(file).st_ino
        except FileNotFoundError:
            same = False
        if same:  # not a file its last holder removed between our open and our lock
            break
        handle.close()
    if exclusive:
        handle.seek(0)
        handle.truncate()
        since = time.strftime("%Y-%m-%d %H:%M:%S")
        handle.write(f"pid {os.getpid()} on {socket.gethostname()}, since {since}\n{target}\n")
        handle.flush()
    return handle


def _refusal(file: Path, path: Path, target: Path) -> ConfigError:
    """Why ``path``'s lock is busy: a job writing ``path`` (its exclusive holder, named), or
    jobs writing inside it (shared holders only)."""
    holder = _holder(file)
    if holder is not None:
        if path == target:
            where = f"output {target} is being written by another run ({holder[0]})"
        else:
            where = f"output {target} is inside {path}, which another run is writing ({holder[0]})"
    else:
        inside = [h for h in map(_holder, registry().glob("*.lock")) if _is_under(h, target)]
        named = f" ({inside[0][0]}, writing {inside[0][1]})" if inside else ""
        where = f"output {target} contains the output of another running job{named}"
    return ConfigError(f"{where}: wait for it to finish, or choose another -o")


def _holder(file: Path) -> tuple[str, Path] | None:
    """``(who, path)`` of the job holding ``file`` exclusively, ``None`` if none does."""
    try:
        with open(file) as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError as err:
                if err.errno not in BUSY:
                    raise
                lines = handle.read(4096).splitlines()
                return (lines[0] if lines else "another process"), Path(
                    lines[1] if len(lines) > 1 else ""
                )
            return None  # released by _holder's own close
    except FileNotFoundError:
        return None


def _is_under(holder: tuple[str, Path] | None, target: Path) -> bool:
    return holder is not None and holder[1] != target and holder[1].is_relative_to(target)


def _release(file: Path, handle) -> None:
    """Close ``handle``; remove its file first if no other job holds it (a registry that does
    not grow with every path ever written)."""
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        pass  # another job holds it too: it stays
    else:
        with contextlib.suppress(FileNotFoundError):
            file.unlink()  # before closing: whoever opens it next makes a new one
    handle.close()
