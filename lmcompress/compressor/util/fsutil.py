"""Writing outputs so that nobody ever sees half of one: build in a temporary sibling, rename.

One helper for every writer in lmcompress (exported models, the model cache, trainer
checkpoints, corpus caches): a run killed half-way leaves the old output (or none), never a
partial one.

A temporary sibling is named after its owner, ``.{name}.tmp-{pid}-{host}-XXXXXXXX`` (the
trash of a replaced output ``.{name}.old-{pid}-{host}-XXXXXXXX``), so that what a killed run
(SIGKILL, power loss) leaves behind can be told from what a running one is still writing:
:func:`sweep_stale` removes the siblings whose process is gone, and every writer calls it
before it starts. The host is in the name because a pid only means something on its own
machine (a cache directory on a shared filesystem is written from several).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from lmcompress.errors import LmcompressError

logger = logging.getLogger(__name__)

# A sibling whose owner cannot be checked (another host, or a name from before the owner was
# recorded) counts as abandoned once nothing in it has been written for this long.
UNCHECKABLE_STALE_AFTER_S = 3600.0


def current_umask() -> int:
    """The process umask, read without changing it where Linux allows (``/proc``);
    elsewhere set and restored at once (which races with other threads creating files)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    umask = os.umask(0o077)
    os.umask(umask)
    return umask


def make_ordinary_(root: str | Path) -> None:
    """Give ``root`` and everything under it the modes of ordinary new files and directories
    (``0o666`` / ``0o777`` less the umask): ``mkdtemp``, ``mkstemp`` and safetensors'
    ``save_file`` create private ones (0700 / 0600) that other users cannot read."""
    umask = current_umask()
    root = Path(root)
    if not root.is_dir():
        root.chmod(0o666 & ~umask)
        return
    root.chmod(0o777 & ~umask)
    for parent, dirs, files in os.walk(root):
        for name in dirs:
            path = os.path.join(parent, name)
            if not os.path.islink(path):
                os.chmod(path, 0o777 & ~umask)
        for name in files:
            path = os.path.join(parent, name)
            if not os.path.islink(path):
                os.chmod(path, 0o666 & ~umask)


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname())[:40] or "localhost"


def _prefix(target: Path, kind: str) -> str:
    return f".{target.name}.{kind}-{os.getpid()}-{_host()}-"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    except (OSError, OverflowError):  # pid out of range: nothing runs under it
        return False
    return True


def _last_write(path: Path) -> float:
    """Newest modification time in ``path``'s tree: a writer at work keeps it recent."""
    newest = path.lstat().st_mtime
    if path.is_dir() and not path.is_symlink():
        for parent, _, files in os.walk(path):
            for name in files:
                with contextlib.suppress(OSError):
                    newest = max(newest, os.lstat(os.path.join(parent, name)).st_mtime)
    return newest


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def sweep_stale(target: str | Path) -> list[Path]:
    """Remove the temporary siblings of ``target`` that killed runs left behind.

    A sibling whose owner (pid on this host) is no longer running is removed; one whose owner
    runs is left alone (another process building the same cache). A sibling whose owner cannot
    be checked (another host, or the pid-less names of earlier versions) is removed once
    nothing in it was written for :data:`UNCHECKABLE_STALE_AFTER_S`, else left with a warning.
    If a killed run had moved ``target`` aside to replace it and died before renaming the new
    one in, the old ``target`` is put back.

    Returns:
        The paths removed.
    """
    target = Path(target)
    if not target.parent.is_dir():
        return []
    name = re.escape(target.name)
    ours = re.compile(rf"\.{name}\.(tmp|old)-(\d+)-(.+)-[a-z0-9_]{{8}}")  # mkdtemp's 8
    pidless = re.compile(rf"\.{name}\.(?:(tmp|old)-[a-z0-9_]{{8}}|[a-z0-9_]{{8}}\.tmp)")
    host, now = _host(), time.time()
    stale, young = [], []
    for path in sorted(target.parent.iterdir()):
        if match := ours.fullmatch(path.name):
            kind, pid, owner = match.group(1), int(match.group(2)), match.group(3)
            if owner == host:
                if pid == os.getpid() or _pid_alive(pid):
                    continue
                stale.append((path, kind))
                continue
        elif match := pidless.fullmatch(path.name):
            kind = match.group(1) or "tmp"
        else:
            continue
        with contextlib.suppress(FileNotFoundError):  # its owner finished meanwhile
            recent = now - _last_write(path) < UNCHECKABLE_STALE_AFTER_S
            (young if recent else stale).append((path, kind))
    removed = []
    for path, kind in stale:
        try:
            if kind == "old" and os.path.lexists(path / "old") and not os.path.lexists(target):
                os.replace(path / "old", target)  # killed between the two renames of a replace
                logger.warning("put back %s, which a killed run had moved aside", target)
            _remove(path)
        except FileNotFoundError:
            continue
        except OSError as err:
            logger.warning("cannot remove %s, left by a killed run: %s", path, err)
            continue
        removed.append(path)
    if removed:
        logger.warning(
            "removed %d stale temporary item(s) left by a killed run next to %s",
            len(removed),
            target,
        )
    if young:
        logger.warning(
            "left %d temporary item(s) next to %s that a run elsewhere may still be writing "
            "(remove them if none is): %s",
            len(young),
            target,
            ", ".join(str(path) for path, _ in young),
        )
    return removed


@contextlib.contextmanager
def atomic_dir(
    target: str | Path,
    replace: bool = True,
    keep_existing: bool = False,
    changed: Callable[[Path], str | None] | None = None,
) -> Iterator[Path]:
    """Yield an empty temporary directory next to ``target``; on success, rename it to ``target``.

    Args:
        replace: an existing ``target`` is replaced (only once the new one is complete).
            Otherwise an existing ``target`` raises ``FileExistsError``.
        keep_existing: if another process created ``target`` meanwhile, keep theirs and drop
            ours (caches that two processes may build at once).
        changed: called with the existing ``target`` once it is moved aside (nobody can
            write into it by its name then): what in it must not be lost, or ``None``. If it
            names something, the old ``target`` is put back, the new one is kept beside it
            (``{name}.new-XXXXXXXX``) and :class:`OutputChanged` is raised.

    Stale siblings of killed runs are swept first (:func:`sweep_stale`). On an exception
    (``KeyboardInterrupt`` and the CLI's SIGTERM included) the temporary directory is removed
    and ``target`` is untouched. Before the rename every file and directory in it gets the
    modes of an ordinary ``open``/``mkdir`` (:func:`make_ordinary_`).
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale(target)
    tmp = Path(tempfile.mkdtemp(prefix=_prefix(target, "tmp"), dir=target.parent))
    try:
        yield tmp
        make_ordinary_(tmp)
        if target.exists():
            if keep_existing:
                return
            if not replace:
                raise FileExistsError(f"{target} exists")
            trash = Path(tempfile.mkdtemp(prefix=_prefix(target, "old"), dir=target.parent))
            os.replace(target, trash / "old")
            reason = changed(trash / "old") if changed is not None else None
            if reason is not None:
                os.replace(trash / "old", target)
                shutil.rmtree(trash, ignore_errors=True)
                kept = Path(tempfile.mkdtemp(prefix=f"{target.name}.new-", dir=target.parent))
                os.replace(tmp, kept)  # a directory may replace an empty one
                raise OutputChanged(target, reason, kept)
            try:
                os.replace(tmp, target)
            except BaseException:
                os.replace(trash / "old", target)  # put the old one back
                raise
            shutil.rmtree(trash, ignore_errors=True)
        else:
            try:
                os.replace(tmp, target)
            except OSError:  # another process renamed its copy in first: keep theirs
                if not (keep_existing and target.is_dir()):
                    raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already after a successful rename


class OutputChanged(LmcompressError):
    """An output that someone else wrote into while a job built its replacement: the job kept
    it and left its own result beside it, at ``kept``."""

    def __init__(self, target: Path, reason: str, kept: Path) -> None:
        super().__init__(
            f"output {target} changed while the job ran ({reason}): it was not replaced; the "
            f"job's result is in {kept}"
        )
        self.target, self.kept = target, kept


def tree_state(root: Path) -> frozenset[tuple] | None:
    """What is in ``root`` (``None``: it does not exist), to tell later whether anyone wrote
    into it: per entry its path relative to ``root``, kind, inode, size and modification time
    (a directory's own times left out: they change when an entry comes and goes again)."""
    if not os.path.lexists(root):
        return None
    entries = set()
    for parent, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(parent, name)
            with contextlib.suppress(FileNotFoundError):
                info = os.lstat(path)
                stamp = (
                    ()
                    if name in dirs and not os.path.islink(path)
                    else (info.st_size, info.st_mtime_ns)
                )
                entries.add((os.path.relpath(path, root), info.st_mode >> 12, info.st_ino, *stamp))
    return frozenset(entries)


def tree_change(before: frozenset[tuple] | None, after: frozenset[tuple] | None) -> str | None:
    """What differs between two :func:`tree_state` s of one directory, in a few words naming
    the first path; ``None`` if nothing does."""
    before, after = before or frozenset(), after or frozenset()
    if before == after:
        return None
    new = sorted({e[0] for e in after} - {e[0] for e in before})
    gone = sorted({e[0] for e in before} - {e[0] for e in after})
    if new:
        return f"{len(new)} new item(s) such as {new[0]}"
    if gone:
        return f"{len(gone)} item(s) removed such as {gone[0]}"
    return f"{sorted(e[0] for e in after - before)[0]} was rewritten"


@contextlib.contextmanager
def atomic_file(target: str | Path, mode: str = "w", **open_kwargs) -> Iterator:
    """Open a temporary file next to ``target`` for writing; rename it to ``target`` on success.

    Stale siblings are swept first and the file gets ordinary permissions, as in
    :func:`atomic_dir`.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale(target)
    fd, tmp = tempfile.mkstemp(prefix=_prefix(target, "tmp"), dir=target.parent)
    try:
        with os.fdopen(fd, mode, **open_kwargs) as handle:
            make_ordinary_(tmp)  # mkstemp makes it private; the output is an ordinary file
            yield handle
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _make_parents(directory: Path) -> list[Path]:
    """``mkdir -p directory``; the directories it created, deepest first."""
    missing = []
    while not directory.exists():
        missing.append(directory)
        directory = directory.parent
    for path in reversed(missing):
        with contextlib.suppress(FileExistsError):
            path.mkdir()
    return missing


def _remove_empty(directories: list[Path]) -> None:
    for path in directories:
        try:
            path.rmdir()
        except OSError:  # something was written into it (the output): keep it
            return


NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def is_disk_full(err: BaseException) -> bool:
    """Whether ``err`` (an ``OSError``, or safetensors' error, which carries only a message)
    says the filesystem or quota is full."""
    if isinstance(err, OSError) and err.errno in NO_SPACE:
        return True
    text = str(err)
    return any(os.strerror(code) in text for code in NO_SPACE) or "os error 28" in text


def no_space_error(target: str | Path, needed: int | None = None) -> LmcompressError:
    """The one-line error of a write to ``target`` that found its filesystem full."""
    free = free_bytes(Path(target))
    need = f"needs about {format_bytes(needed)}; " if needed else ""
    return LmcompressError(
        f"no space left on the device writing {target} ({need}{format_bytes(free)} free): "
        "free space or write elsewhere"
    )


@contextlib.contextmanager
def disk_full_as_error(target: str | Path, needed: int | None = None) -> Iterator[None]:
    """Turn a full disk while writing ``target`` into a one-line :class:`LmcompressError`: the
    path, the bytes the write needed (where known) and the bytes free. Enter it outside the
    writer's ``atomic_dir``, whose cleanup has then run: nothing half-written is left."""
    try:
        yield
    except Exception as err:
        if isinstance(err, LmcompressError) or not is_disk_full(err):
            raise
        raise no_space_error(target, needed) from None


@contextlib.contextmanager
def made_dirs(directory: str | Path) -> Iterator[Path]:
    """``mkdir -p directory`` for the ``with`` block; the directories it created are removed
    afterwards if they are empty again (a work directory that leaves nothing behind)."""
    created = _make_parents(Path(directory))
    try:
        yield Path(directory)
    finally:
        _remove_empty(created)


def free_bytes(path: Path) -> int:
    """Free bytes (for this user) on the filesystem that holds ``path`` or, while it does not
    exist, its nearest existing ancestor."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def format_bytes(count: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} B"
