"""``optimum-cli lmcompress``: the compression job of ``compress-model`` as an optimum command.

optimum-cli (optimum >= 2) imports every module in the ``optimum.commands.register`` namespace
at start-up and registers the commands each lists in ``REGISTER_COMMANDS``; ours
(``optimum/commands/register/lmcompress.py``, installed with this package) only calls into
here, and only when its command is the one being run, so that ``optimum-cli export ...`` does
not pay for importing torch and lmcompress.

The flags are defined by :func:`lmcompress.cli.compress.add_job_arguments`, as for
``compress-model``, on the parser optimum creates for the command. Which method's options exist
depends on ``--method`` (or the recipe's), which optimum's parser cannot know before parsing:
like ``compress-model``, we read it from the command line first (``sys.argv`` after the command
name, the line optimum's parser is about to parse). Errors of ours are one line and exit 2;
argparse's own (an unknown flag, a bad choice) are printed by optimum's parser, usage first.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from lmcompress.cli.compress import JobFlags, add_job_arguments, run_job
from lmcompress.cli.terminal import guarded, quiet_environment
from lmcompress.errors import LmcompressError

COMMAND = "lmcompress"
PROG = f"optimum-cli {COMMAND}"
_FLAGS = "lmcompress_job_flags"  # the parser default that carries the JobFlags to run()


def add_arguments(parser: argparse.ArgumentParser, argv: Sequence[str]) -> None:
    """Define the job's flags for the command line ``argv`` (what follows the command name).

    An unknown ``--method`` or an unreadable recipe ends the process here, with one line and
    exit 2: without the method there are no flags to define, and optimum-cli would otherwise
    report every method option as unrecognized."""
    quiet_environment(argv)
    try:
        flags = add_job_arguments(parser, argv, prog=PROG)
    except LmcompressError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        sys.exit(2)
    parser.set_defaults(**{_FLAGS: flags})


def run(args: argparse.Namespace) -> int:
    """Run the job optimum's parser parsed; returns the exit code."""
    values = vars(args).copy()
    flags: JobFlags = values.pop(_FLAGS)
    values.pop("func", None)  # optimum's dispatch entry
    return guarded(PROG, run_job, values, flags)
