"""The output directory of a save or a job, and every rule about it, in one object.

:class:`OutputDir` holds the path and ``overwrite`` and checks each rule once, however many
steps of a job hold it (the lock, the preflight of every stage, the save):

- :meth:`OutputDir.writable`: the path can be created or written
  (:func:`~lmcompress.compressor.util.paths.check_writable`: beside it, since the output is
  built in a temporary sibling);
- :meth:`OutputDir.check`: and replacing it destroys no input (an output equal to an input,
  inside one or containing one is refused, even with ``overwrite``), it is empty unless
  ``overwrite``; the debris of a killed run beside it is removed;
- :meth:`OutputDir.lock`: a second job naming the same output, one inside it or one around it,
  is refused while this one runs (:mod:`~lmcompress.compressor.util.locks`);
- :meth:`OutputDir.guarded`: a full disk while writing it is one line (once, however nested);
- :meth:`OutputDir.build`: its files are written into a temporary sibling renamed into place at
  the end, so a failed or killed write leaves the old output (or none), never half of one;
  and if anything in the output changed since :meth:`OutputDir.check` looked (someone wrote
  into it while the job ran), it is not replaced: the job's result is kept beside it and the
  job fails in one line naming both (:class:`~lmcompress.compressor.util.fsutil.OutputChanged`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from lmcompress.compressor.util.fsutil import (
    atomic_dir,
    disk_full_as_error,
    made_dirs,
    sweep_stale,
    tree_change,
    tree_state,
)
from lmcompress.compressor.util.locks import output_lock
from lmcompress.compressor.util.paths import check_writable
from lmcompress.errors import ConfigError, LmcompressError


class OutputDir:
    """An output directory: ``path`` as given, and whether an existing one may be replaced."""

    def __init__(
        self, path: str | os.PathLike, overwrite: bool = False, reads: Iterable[Path] = ()
    ) -> None:
        """``reads``: paths the job read before it started (a recipe), checked as inputs."""
        self.given = path
        self.reads = tuple(reads)
        self.path = Path(path)
        self.overwrite = overwrite
        self._resolved: Path | None = None  # set once writable() has passed
        self._checked = False
        self._inputs: set[Path] = set()  # the inputs already checked against it
        self._guarded = False
        self._before: frozenset[tuple] | None = None  # what was in it when check() looked

    @classmethod
    def of(cls, out: str | os.PathLike | OutputDir, overwrite: bool = False) -> OutputDir:
        """``out`` itself if it is an :class:`OutputDir` (with its own ``overwrite``), else a
        new one."""
        return out if isinstance(out, OutputDir) else cls(out, overwrite)

    def __repr__(self) -> str:
        return f"OutputDir({os.fspath(self.given)!r}, overwrite={self.overwrite})"

    def writable(self) -> Path:
        """The resolved path, once it is known that it can be created or written."""
        if self._resolved is None:
            self._resolved = check_writable(self.given, "output", inside=False)
        return self._resolved

    def check(self, inputs: Iterable[Path] = ()) -> OutputDir:
        """Every rule that needs no writing (module doc); ``inputs``: the local paths the job
        reads, each compared once. Returns ``self``."""
        out = self.writable()
        for path in (*self.reads, *inputs):
            source = Path(path).expanduser().resolve()
            if source not in self._inputs:
                self._refuse_input(out, source, path)
                self._inputs.add(source)
        if self._checked:
            return self
        if out.exists() and any(out.iterdir()) and not self.overwrite:
            raise LmcompressError(f"output directory {self.given} is not empty (use --overwrite)")
        self._before = tree_state(out)
        if out.parent.is_dir():
            sweep_stale(out)
        self._checked = True
        return self

    def _refuse_input(self, out: Path, source: Path, shown: Path) -> None:
        if out == source:
            relation = "is"
        elif out.is_relative_to(source):
            relation = "is inside"
        elif source.is_relative_to(out):
            relation = "contains"
        else:
            return
        raise ConfigError(
            f"output {self.given} {relation} the input {shown}: writing it would destroy the "
            "input (even with --overwrite); choose another -o"
        )

    @contextlib.contextmanager
    def lock(self) -> Iterator[OutputDir]:
        """Hold the output's lock (:func:`~lmcompress.compressor.util.locks.output_lock`: no
        other job writes it, inside it or around it) for the ``with`` block, the path checked
        writable first."""
        out = self.writable()
        with made_dirs(out.parent), output_lock(out):  # parents it made go if left empty
            yield self

    @contextlib.contextmanager
    def guarded(self) -> Iterator[None]:
        """A full disk inside the block is one :class:`LmcompressError` naming the output;
        nested blocks convert it once, in the outermost (after every inner cleanup ran)."""
        if self._guarded:
            yield
            return
        self._guarded = True
        try:
            with disk_full_as_error(self.given):
                yield
        finally:
            self._guarded = False

    @contextlib.contextmanager
    def build(self) -> Iterator[Path]:
        """Yield an empty temporary sibling to write the output into; it becomes the output
        at the end (replacing the old one), or is removed on an error. Checks the output
        first if nothing did."""
        self.check()
        with self.guarded(), atomic_dir(self.path, changed=self.changed) as tmp:
            yield tmp

    def changed(self, old: Path) -> str | None:
        """What differs in ``old`` (the output, moved aside at the rename) from what
        :meth:`check` saw when the job started; ``None``: nothing, it may be replaced."""
        return tree_change(self._before, tree_state(old))
