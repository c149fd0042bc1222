"""``compress-model methods``: every method, its description and its options with their
defaults as typed on the command line (``wiki-test``, ``none``, ``2:4``)."""

from __future__ import annotations

import inspect
import textwrap
from collections.abc import Sequence

from lmcompress.cli.flags import describe
from lmcompress.cli.terminal import PROG, Parser
from lmcompress.methods import METHODS

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


def methods_parser() -> Parser:
    return Parser(
        prog=f"{PROG} methods",
        description="List methods (each config's description) and their options, each with "
        "its default as typed on the command line.",
    )


def list_methods(argv: Sequence[str]) -> int:
    methods_parser().parse_args(argv)
    for name, method_class in METHODS.items():
        print(wrapped(first_paragraph(method_class.config_class.__doc__), f"{name}: ", "    "))
        for flag, default, help_text in describe(method_class.config_class):
            row = f"  {flag:<22} {default:<16} "
            print(wrapped(help_text, row, " " * min(len(row), 42)))
    return 0
