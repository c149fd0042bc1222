"""Every real parser of ``compress-model``, by the key :mod:`lmcompress.cli.help_spec` files it
under: what ``scripts/write_help_spec.py`` writes down and ``tests/cli/test_help_spec.py``
compares with what is written (this module imports torch; ``help_spec`` does not)."""

from __future__ import annotations

import argparse
from typing import Any

from lmcompress.cli.bench import bench_parser
from lmcompress.cli.compress import add_job_arguments
from lmcompress.cli.evaluate import eval_parser
from lmcompress.cli.help_spec import describe_parser
from lmcompress.cli.listing import methods_parser
from lmcompress.cli.terminal import PROG, Parser
from lmcompress.methods import METHODS


def job_parser(method: str) -> argparse.ArgumentParser:
    """``compress-model --method METHOD``'s parser."""
    parser = Parser(prog=PROG)
    add_job_arguments(parser, ["--method", method])
    return parser


def described_parsers() -> dict[str, Any]:
    """The content of ``lmcompress/cli/parsers.json``."""
    return {
        "methods": describe_parser(methods_parser()),
        "eval": describe_parser(eval_parser()),
        "bench": describe_parser(bench_parser()),
        "job": {name: describe_parser(job_parser(name)) for name in METHODS},
    }
