"""What every command line shares: the one-line usage errors, logging, ``-q``, and the exit
codes (a user error is 2, Ctrl-C 130, SIGTERM 143, each after the same clean-up)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from lmcompress.errors import ConfigError, LmcompressError, printable

PROG = "compress-model"


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the process was so that the same clean-up as for Ctrl-C runs
    (temporary output directories removed, nothing half-written left behind)."""


def raise_terminated(signum: int, _frame: Any) -> NoReturn:
    raise Terminated(signal.Signals(signum).name)


class Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line (exit 2) instead of usage + message,
    and refuses an option given twice (argparse keeps the last silently; a recipe refuses a
    key given twice, and so does the command line), under any of its spellings (``-o`` and
    ``--output``, ``--dense-copy`` and ``--no-dense-copy``, an abbreviation)."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        self.refuse_repeats(args)
        return super().parse_known_args(args, namespace)

    def refuse_repeats(self, args: Sequence[str]) -> None:
        """A one-line :class:`ConfigError` if two of ``args`` set the same option."""
        flags = self._option_string_actions  # argparse's map of every spelling to its action
        seen: dict[str, str] = {}
        for token in args:
            if token == "--":
                break
            name = token.split("=", 1)[0] if token.startswith("--") else token[:2]
            if name not in flags and name.startswith("--") and self.allow_abbrev:
                matches = {flags[f].dest for f in flags if f.startswith(name)}
                name = next(f for f in flags if f.startswith(name)) if len(matches) == 1 else name
            action = flags.get(name)
            if action is None or action.dest == "help":
                continue
            if action.dest in seen:
                first = seen[action.dest]
                also = "" if first == name else f" (as {first} and {name})"
                raise ConfigError(f"{name} is given twice{also}: give it once")
            seen[action.dest] = name


class PrintableFormatter(logging.Formatter):
    """Log lines with :func:`printable` messages (the traceback of an exception, if logged,
    keeps its lines)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return printable(super().formatMessage(record))


def setup_logging(quiet: bool) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(
        PrintableFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    )
    logging.basicConfig(level=logging.WARNING if quiet else logging.INFO, handlers=[handler])


def quiet_environment(argv: Sequence[str]) -> None:
    """``-q``: no progress bars. tqdm reads TQDM_DISABLE once, when it is imported: call this
    before anything imports it (transformers, if imported already, is told directly)."""
    if "-q" in argv or "--quiet" in argv:
        os.environ["TQDM_DISABLE"] = "1"
        transformers = sys.modules.get("transformers")
        if transformers is not None:  # imported already (optimum-cli does): tell it directly
            transformers.utils.logging.disable_progress_bar()


def guarded(prog: str, command: Callable[..., int], *args: Any) -> int:
    """``command(*args)`` with the CLI's exit codes: a user error is one line on stderr and 2,
    Ctrl-C 130, SIGTERM 143 (raised where the process was, so clean-up runs as for Ctrl-C)."""
    previous = signal.getsignal(signal.SIGTERM)
    try:
        signal.signal(signal.SIGTERM, raise_terminated)
    except ValueError:  # not the main thread (main() called from a worker): leave it alone
        previous = None
    try:
        return command(*args)
    except LmcompressError as err:
        print(f"{prog}: error: {printable(err)}", file=sys.stderr)
        return 2
    except Terminated:
        print(f"{prog}: terminated", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
