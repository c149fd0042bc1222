"""mkdocs hook: the CLI reference (``docs/cli.md``) generated from the argparse definitions.

The page holds a placeholder, :data:`PLACEHOLDER`, replaced at build time by the help of every
``compress-model`` command, so the reference cannot drift from the flags:

- the compression job: the parser :func:`lmcompress.cli.compress.add_job_arguments` builds
  (the one ``compress-model`` and ``optimum-cli lmcompress`` both use), with the default
  method's options, then each method's own option group as
  :func:`lmcompress.cli.flags.add_dataclass_flags` defines it from the method's config class;
- ``methods``, ``eval`` and ``bench``: each command of :data:`lmcompress.cli.main.COMMANDS`
  builds its parser inside the command, so its ``--help`` output is captured (argparse prints
  ``format_help()`` and exits 0; nothing else runs).

Help is formatted at a fixed width (``COLUMNS``) so that the page does not depend on the
terminal that builds it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
from collections.abc import Callable, Iterator, Sequence

PLACEHOLDER = "<!-- cli-reference -->"
WIDTH = "100"


@contextlib.contextmanager
def fixed_width() -> Iterator[None]:
    """argparse sizes help to ``shutil.get_terminal_size()``, which reads ``COLUMNS`` first."""
    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = WIDTH
    try:
        yield
    finally:
        if previous is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = previous


def captured_help(command: Callable[[Sequence[str]], int]) -> str:
    """What ``command(["--help"])`` prints: its parser's ``format_help()``."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        command(["--help"])
    return out.getvalue()


def job_help() -> str:
    from lmcompress.cli.compress import add_job_arguments
    from lmcompress.cli.terminal import PROG, Parser

    parser = Parser(prog=PROG)
    add_job_arguments(parser, [])
    return parser.format_help()


def method_help(name: str) -> str:
    """One method's option group, as ``compress-model --method NAME --help`` shows it."""
    from lmcompress.cli.flags import add_dataclass_flags
    from lmcompress.methods import get_method

    config_class = get_method(name).config_class
    parser = argparse.ArgumentParser(usage=argparse.SUPPRESS, add_help=False)
    add_dataclass_flags(parser.add_argument_group(f"{name} options"), config_class)
    return parser.format_help()


def first_paragraph(doc: str) -> str:
    """A docstring's first paragraph on one line (its summary, however it is wrapped)."""
    return " ".join(doc.strip().split("\n\n")[0].split())


def block(text: str) -> str:
    return f"```text\n{text.rstrip()}\n```\n"


def cli_reference() -> str:
    from lmcompress.cli.main import COMMANDS
    from lmcompress.methods import METHODS

    with fixed_width():
        parts = [
            "## `compress-model [CHECKPOINT] --method NAME ...`: the compression job\n",
            "The job's flags and, last, the options of the default method (magnitude); "
            "every method's own options follow.\n",
            block(job_help()),
        ]
        for name, method_class in METHODS.items():
            summary = first_paragraph(method_class.config_class.__doc__ or "")
            parts += [f"### `--method {name}`\n", f"{summary}\n", block(method_help(name))]
        for name, command in COMMANDS.items():
            parts += [f"## `compress-model {name}`\n", block(captured_help(command))]
    return "\n".join(parts)


def on_page_markdown(markdown: str, page, **_: object) -> str:
    """mkdocs event: fill the placeholder of ``cli.md``."""
    if page.file.src_uri != "cli.md":
        return markdown
    if PLACEHOLDER not in markdown:
        raise ValueError(f"docs/cli.md lost its placeholder {PLACEHOLDER}")
    return markdown.replace(PLACEHOLDER, cli_reference())
