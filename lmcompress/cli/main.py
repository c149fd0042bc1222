"""``compress-model``: compress a checkpoint, list methods, or score a model.

    compress-model [CHECKPOINT] --method magnitude --sparsity 2:4 -o OUT
    compress-model methods
    compress-model eval CHECKPOINT_OR_OUT --data wiki-test [--runtime packed|dense]
    compress-model bench CHECKPOINT [OUT ...] [--prefill 4x256] [--decode 32] [-o DIR]

Exit codes: 0 success; 2 a user error (one line on stderr, nothing written); 130 interrupted
(Ctrl-C, SIGINT); 143 terminated (SIGTERM). An interrupted or terminated run cleans up what it
was writing, exactly as on an error. The CLI parses and prints; the work is
:mod:`lmcompress.jobs`'.

This module imports nothing heavy: ``--help`` is answered from the parsers' description
(:mod:`lmcompress.cli.help_spec`) without importing torch, and each command's module (which
imports torch) is imported when the command runs.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from lmcompress.cli.help_spec import spec_parser, wants_help
from lmcompress.cli.terminal import PROG, Terminated, guarded, quiet_environment

__all__ = ["COMMANDS", "Terminated", "main"]


def list_methods(argv: Sequence[str]) -> int:
    from lmcompress.cli.listing import list_methods as command

    return command(argv)


def evaluate_command(argv: Sequence[str]) -> int:
    from lmcompress.cli.evaluate import evaluate_command as command

    return command(argv)


def bench_command(argv: Sequence[str]) -> int:
    from lmcompress.cli.bench import bench_command as command

    return command(argv)


def compress(argv: Sequence[str]) -> int:
    from lmcompress.cli.compress import compress as command

    return command(argv)


COMMANDS = {"methods": list_methods, "eval": evaluate_command, "bench": bench_command}


def print_help(argv: Sequence[str]) -> int:
    """``--help`` from the parsers' description: argparse prints it and exits 0 (or reports a
    bad flag before it, as the real parser would). Where the description cannot know the
    parser (a recipe names the method), the real command answers."""
    parser = spec_parser(list(argv), tuple(COMMANDS))
    if parser is None:
        command = COMMANDS.get(argv[0]) if argv else None
        return command(argv[1:]) if command else compress(argv)
    parser.parse_args(argv[1:] if argv and argv[0] in COMMANDS else argv)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    quiet_environment(argv)
    if wants_help(argv):
        return guarded(PROG, print_help, argv)
    command = COMMANDS.get(argv[0]) if argv else None
    if command:
        return guarded(PROG, command, argv[1:])
    return guarded(PROG, compress, argv)


if __name__ == "__main__":
    sys.exit(main())
