"""``compress-model``: compress a checkpoint, list methods, or score a model.

    compress-model [CHECKPOINT] --method magnitude --sparsity 2:4 -o OUT
    compress-model methods
    compress-model eval CHECKPOINT_OR_OUT --data wiki-test [--runtime packed|dense]
    compress-model bench CHECKPOINT [OUT ...] [--prefill 4x256] [--decode 32] [-o DIR]

Exit codes: 0 success; 2 a user error (one line on stderr, nothing written); 130 interrupted
(Ctrl-C, SIGINT); 143 terminated (SIGTERM). An interrupted or terminated run cleans up what it
was writing, exactly as on an error. The CLI parses and prints; the work is
:mod:`lmcompress.jobs`'.
"""

from __future__ import annotations

import inspect
import sys
import textwrap
from collections.abc import Sequence

from lmcompress.cli.bench import bench_command
from lmcompress.cli.compress import compress
from lmcompress.cli.evaluate import evaluate_command
from lmcompress.cli.flags import describe
from lmcompress.cli.terminal import PROG, Parser, Terminated, guarded, quiet_environment
from lmcompress.methods import METHODS

__all__ = ["COMMANDS", "Terminated", "main"]


WIDTH = 100  # of `compress-model methods`' lines: descriptions and helps wrap, never cut


def first_paragraph(doc: str | None) -> str:
    """The first paragraph of a docstring, on one line."""
    return " ".join(inspect.cleandoc(doc or "").split("\n\n")[0].split())


def wrapped(text: str, first: str, rest: str) -> str:
    """``first + text`` wrapped at :data:`WIDTH`, its next lines indented by ``rest``."""
    return textwrap.fill(
        text,
        WIDTH,
        initial_indent=first,
        subsequent_indent=rest,
        break_on_hyphens=False,
        break_long_words=False,
    )


def list_methods(argv: Sequence[str]) -> int:
    parser = Parser(
        prog=f"{PROG} methods",
        description="List methods (each config's description) and their options.",
    )
    parser.parse_args(argv)
    for name, method_class in METHODS.items():
        print(wrapped(first_paragraph(method_class.config_class.__doc__), f"{name}: ", "    "))
        for flag, default, help_text in describe(method_class.config_class):
            row = f"  {flag:<22} {default:<14} "
            print(wrapped(help_text, row, " " * min(len(row), 40)))
    return 0


COMMANDS = {"methods": list_methods, "eval": evaluate_command, "bench": bench_command}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    quiet_environment(argv)
    command = COMMANDS.get(argv[0]) if argv else None
    if command:
        return guarded(PROG, command, argv[1:])
    return guarded(PROG, compress, argv)


if __name__ == "__main__":
    sys.exit(main())
