"""``--help`` without importing torch: every parser of ``compress-model`` as data.

The flags of a compression job come from the methods' config dataclasses, and those live beside
the methods' torch code, so building the real parser imports torch and transformers (5-11 s).
``--help`` needs none of that: :func:`spec_parser` rebuilds a parser from ``parsers.json``, a
description of each real parser (its groups and actions) written by
``scripts/write_help_spec.py``. ``tests/cli/test_help_spec.py`` compares the file with the real
parsers, so the two cannot drift: a new option fails that test until the file is rewritten.
Only ``--help`` is answered from the file; a job always parses with the real parser.
"""

from __future__ import annotations

import argparse
import json
from functools import cache
from pathlib import Path
from typing import Any

from lmcompress.cli.flags import BooleanFlag
from lmcompress.cli.terminal import PROG, Parser

SPEC = Path(__file__).with_name("parsers.json")
TYPES: dict[str, Any] = {"int": int, "float": float, "str": str}
# argparse's action classes by name (their classes are private to argparse) and ours
ACTIONS: dict[str, Any] = {
    "_StoreAction": "store",
    "_StoreTrueAction": "store_true",
    "_StoreFalseAction": "store_false",
    "_HelpAction": "help",
    "BooleanFlag": BooleanFlag,
}
HELP_FLAGS = ("-h", "--help")


def describe_action(action: argparse.Action) -> dict[str, Any]:
    kind = type(action).__name__
    if kind not in ACTIONS:
        raise TypeError(f"no spec for argparse action {kind} ({action.dest})")
    flags = list(action.option_strings)
    if kind == "BooleanFlag":  # it adds --no-X itself
        flags = [f for f in flags if not f.startswith("--") or f"--no-{f[2:]}" in flags]
    described = {"flags": flags, "kind": kind, "dest": action.dest, "help": action.help}
    for key in ("nargs", "default", "choices", "metavar", "required"):
        value = getattr(action, key)
        if key == "nargs" and value == 0:  # a switch: its action class sets that itself
            continue
        if value is not None and value is not False:  # 0 is a value (a default of 0)
            described[key] = list(value) if isinstance(value, tuple) and key != "metavar" else value
    if isinstance(action.metavar, tuple):
        described["metavar"] = list(action.metavar)
    if action.type is not None:
        described["type"] = action.type.__name__
    return described


def describe_parser(parser: argparse.ArgumentParser) -> dict[str, Any]:
    """A parser as JSON-able data: its texts and, per group, its actions in order."""
    groups = [
        {
            "title": group.title,
            "description": group.description,
            "actions": [describe_action(action) for action in group._group_actions],
        }
        for group in parser._action_groups  # argparse keeps no public list of its groups
    ]
    return {
        "prog": parser.prog,
        "description": parser.description,
        "epilog": parser.epilog,
        "groups": groups,
    }


def _add_action(group: Any, described: dict[str, Any]) -> None:
    kwargs = {key: described[key] for key in ("nargs", "default", "choices") if key in described}
    if "metavar" in described:
        metavar = described["metavar"]
        kwargs["metavar"] = tuple(metavar) if isinstance(metavar, list) else metavar
    if "type" in described:
        kwargs["type"] = TYPES[described["type"]]
    if described.get("required") and described["flags"]:
        kwargs["required"] = True
    if described["flags"]:
        kwargs["dest"] = described["dest"]
        group.add_argument(
            *described["flags"], action=ACTIONS[described["kind"]], help=described["help"], **kwargs
        )
    else:  # a positional: its dest is its name
        group.add_argument(described["dest"], help=described["help"], **kwargs)


def add_spec_arguments(parser: argparse.ArgumentParser, spec: dict[str, Any]) -> None:
    """Add the groups and actions ``spec`` describes to ``parser`` (a help action only where
    ``parser`` has none: optimum's parsers come with theirs)."""
    groups = {group.title: group for group in parser._action_groups}
    has_help = any(isinstance(a, argparse._HelpAction) for a in parser._actions)
    for group_spec in spec["groups"]:
        group = groups.get(group_spec["title"]) or parser.add_argument_group(
            group_spec["title"], group_spec["description"]
        )
        for described in group_spec["actions"]:
            if not (has_help and described["kind"] == "_HelpAction"):
                _add_action(group, described)


def build_parser(spec: dict[str, Any]) -> Parser:
    """The parser ``spec`` (:func:`describe_parser`'s output) describes."""
    parser = Parser(
        prog=spec["prog"], description=spec["description"], epilog=spec["epilog"], add_help=False
    )
    add_spec_arguments(parser, spec)
    return parser


def job_epilog(epilog: str, prog: str) -> str:
    """A job parser's epilog for another program (``optimum-cli lmcompress``): the text
    :func:`lmcompress.cli.compress.add_job_arguments` writes with ``prog``."""
    return epilog.replace(f"`{PROG} --method NAME --help`", f"`{prog} --method NAME --help`", 1)


@cache
def specs() -> dict[str, Any]:
    """``{"methods" | "eval" | "bench": parser, "job": {method: parser}}`` from :data:`SPEC`."""
    return json.loads(SPEC.read_text())


def wants_help(argv: list[str]) -> bool:
    return any(arg in HELP_FLAGS for arg in argv)


def job_spec(argv: list[str]) -> dict[str, Any] | None:
    """The description of the job parser for the command line ``argv``, or None where the
    file cannot know it (a recipe given with ``--config`` decides the method; an unknown
    method): the real parser then answers, and reports what is wrong."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--method", default="magnitude")
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    jobs = specs()["job"]
    if known.config or known.method not in jobs:
        return None
    return jobs[known.method]


def spec_parser(argv: list[str], commands: tuple[str, ...]) -> Parser | None:
    """The parser that answers ``compress-model ARGV`` when ARGV asks for help, or None where
    :func:`job_spec` cannot know it."""
    if argv and argv[0] in commands:
        return build_parser(specs()[argv[0]])
    spec = job_spec(argv)
    return None if spec is None else build_parser(spec)
