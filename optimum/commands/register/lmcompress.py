"""Registers ``optimum-cli lmcompress`` (optimum >= 2 imports this module at start-up).

This directory and its parents are parts of the ``optimum`` namespace package: no
``__init__.py`` in ``optimum/``, ``optimum/commands/`` or ``optimum/commands/register/``.
Imports stay light (optimum's base classes and ``sys``): lmcompress, and torch with it, is
imported only when this command is the one being run.
"""

import sys

from optimum.commands.base import BaseOptimumCLICommand, CommandInfo

_NAME = "lmcompress"


class LmcompressCommand(BaseOptimumCLICommand):
    COMMAND = CommandInfo(
        name=_NAME,
        help="compress a causal LM with lmcompress: the options of compress-model "
        "(`optimum-cli lmcompress --method NAME --help`)",
    )

    @staticmethod
    def parse_args(parser):
        # optimum calls this for every registered command on every start; defining our flags
        # imports torch, so only when `optimum-cli lmcompress ...` is what runs
        if sys.argv[1:2] == [_NAME]:
            from lmcompress.cli.optimum import add_arguments

            add_arguments(parser, sys.argv[2:])

    def run(self):
        from lmcompress.cli.optimum import run

        sys.exit(run(self.args))


REGISTER_COMMANDS = [LmcompressCommand]
