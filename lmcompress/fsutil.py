"""Writing outputs so that nobody ever sees half of one: build in a temporary sibling, rename.

One helper for every writer in lmcompress (exported models, the model cache, trainer
checkpoints, corpus caches): a run killed half-way leaves the old output (or none), never a
partial one.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_dir(
    target: str | Path, replace: bool = True, keep_existing: bool = False
) -> Iterator[Path]:
    """Yield an empty temporary directory next to ``target``; on success, rename it to ``target``.

    Args:
        replace: an existing ``target`` is replaced (only once the new one is complete).
            Otherwise an existing ``target`` raises ``FileExistsError``.
        keep_existing: if another process created ``target`` meanwhile, keep theirs and drop
            ours (caches that two processes may build at once).

    On an exception the temporary directory is removed and ``target`` is untouched. The
    directory gets the permissions of an ordinary ``mkdir`` (``mkdtemp`` makes it private).
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)
    try:
        yield tmp
        if target.exists():
            if keep_existing:
                return
            if not replace:
                raise FileExistsError(f"{target} exists")
            trash = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.replace(target, trash / "old")
            os.replace(tmp, target)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            try:
                os.replace(tmp, target)
            except OSError:  # another process renamed its copy in first: keep theirs
                if not (keep_existing and target.is_dir()):
                    raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already after a successful rename


@contextlib.contextmanager
def atomic_file(target: str | Path, mode: str = "w", **open_kwargs) -> Iterator:
    """Open a temporary file next to ``target`` for writing; rename it to ``target`` on success."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it private; the output is an ordinary file
    try:
        with os.fdopen(fd, mode, **open_kwargs) as handle:
            yield handle
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
