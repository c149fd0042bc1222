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

from lmcompress.cli.help_spec import add_spec_arguments, job_epilog, job_spec, wants_help
from lmcompress.cli.terminal import guarded, quiet_environment
from lmcompress.errors import LmcompressError, printable

COMMAND = "lmcompress"
PROG = f"optimum-cli {COMMAND}"
_FLAGS = "lmcompress_job_flags"  # the parser default that carries the JobFlags to run()


def add_arguments(parser: argparse.ArgumentParser, argv: Sequence[str]) -> None:
    """Define the job's flags for the command line ``argv`` (what follows the command name).

    An unknown ``--method`` or an unreadable recipe ends the process here, with one line and
    exit 2: without the method there are no flags to define, and optimum-cli would otherwise
    report every method option as unrecognized.

    ``--help`` is answered from the parsers' description (:mod:`lmcompress.cli.help_spec`),
    without importing torch; the job's modules are imported only to run a job."""
    quiet_environment(argv)
    spec = job_spec(list(argv)) if wants_help(argv) else None
    if spec is not None:
        parser.description = spec["description"]
        parser.epilog = job_epilog(spec["epilog"], PROG)
        add_spec_arguments(parser, spec)
        return
    from lmcompress.cli.compress import add_job_arguments

    try:
        flags = add_job_arguments(parser, argv, prog=PROG)
    except LmcompressError as err:
        print(f"{PROG}: error: {printable(err)}", file=sys.stderr)
        sys.exit(2)
    parser.set_defaults(**{_FLAGS: flags})


def run(args: argparse.Namespace) -> int:
    """Run the job optimum's parser parsed; returns the exit code."""
    from lmcompress.cli.compress import JobFlags, run_job

    values = vars(args).copy()
    flags: JobFlags = values.pop(_FLAGS)
    values.pop("func", None)  # optimum's dispatch entry
    return guarded(PROG, run_job, values, flags)
