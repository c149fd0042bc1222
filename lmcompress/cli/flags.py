"""CLI flags generated from config dataclasses: one flag per option, typed from its annotation.

Options of a nested group (``training: TrainingOptions``) become flags of their own under their
own names (``--steps``), as :func:`lmcompress.compressor.config.option_fields` flattens them;
``Literal`` annotations become ``choices``; value types (``Sparsity``) are read as text and
parsed by the config, so that their errors keep the config's one-line message. Field metadata:
``help`` (the text, to which ``(default: ...)`` is appended once), ``default_text`` (the default
in words, where the value would mislead) and ``metavar`` (``("START", "END")``).
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any

from lmcompress.compressor.options import (
    OptionField,
    flag_name,
    is_value_type,
    literal_choices,
    option_fields,
    recipe_value,
)


def _field_kwargs(hint: Any) -> dict[str, Any]:
    choices = literal_choices(hint)
    if choices is not None:
        return {"type": type(choices[0]), "choices": choices}
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":  # X | None
        inner = [a for a in args if a is not type(None)]
        return _field_kwargs(inner[0]) if len(inner) == 1 else {"type": str}
    if hint is bool:
        return {"action": BooleanFlag}
    if origin is tuple:
        element = _field_kwargs(args[0])
        if "type" not in element:
            raise TypeError(f"no CLI flag for a field of type {hint!r}")
        nargs = "*" if len(args) == 2 and args[1] is Ellipsis else len(args)
        return {**element, "nargs": nargs}  # `--eval` alone: none
    if hint in (int, float, str) or is_value_type(hint):
        return {"type": str if is_value_type(hint) else hint}
    raise TypeError(f"no CLI flag for a field of type {hint!r}")


class BooleanFlag(argparse.BooleanOptionalAction):
    """``--x`` / ``--no-x`` with the help as given: Python 3.9 to 3.11 append their own
    ``(default: %(default)s)``, which with ``default=SUPPRESS`` shows a wrong default."""

    def __init__(self, *args: Any, help: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, help=help, **kwargs)
        self.help = help


def shown_default(option: OptionField) -> str:
    """The default as ``--help`` shows it: as typed on the command line (``2:4``, ``4.0 0.05``),
    ``on``/``off`` for a switch, ``none`` for nothing; field metadata ``default_text`` says it
    in words where the value alone would mislead (``include``'s empty default)."""
    if "default_text" in option.field.metadata:
        return option.field.metadata["default_text"]
    default = option.default
    if default is dataclasses.MISSING:
        return "required"
    if isinstance(default, bool):
        return "on" if default else "off"
    value = recipe_value(default)
    if value is None or value == []:
        return "none"
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


def add_dataclass_flags(
    parser: argparse.ArgumentParser | Any,
    cls: type,
    skip: tuple[str, ...] = (),
    aliases: dict[str, str] | None = None,
) -> list[str]:
    """Add one flag per option of ``cls`` with ``default=SUPPRESS`` so that only the flags a
    user gave appear in the namespace (recipes fill the rest). ``aliases`` adds short flags
    (``{"output": "-o"}``). Returns the (flat) option names."""
    aliases = aliases or {}
    names = []
    for option in option_fields(cls):
        if option.name in skip:
            continue
        kwargs = _field_kwargs(option.hint)
        help_text = f"{option.field.metadata.get('help', '')} (default: {shown_default(option)})"
        flags = [aliases[option.name]] if option.name in aliases else []
        metavar = option.field.metadata.get("metavar", option.name.upper())
        metavar = None if "action" in kwargs or "choices" in kwargs else metavar
        parser.add_argument(
            *flags,
            flag_name(option.name),
            dest=option.name,
            default=argparse.SUPPRESS,
            help=help_text.strip().replace("%", "%%"),  # argparse %-formats help
            metavar=metavar,
            **kwargs,
        )
        names.append(option.name)
    return names


def describe(cls: type) -> list[tuple[str, str, str]]:
    """(flag, default, help) for every option, for ``compress-model methods``: the default as
    ``--help`` shows it (:func:`shown_default`: ``2:4``, ``wiki-test``, ``none``, ``off``), and
    a ``Literal`` option's help ending with its choices."""
    rows = []
    for option in option_fields(cls):
        help_text = option.field.metadata.get("help", "")
        choices = literal_choices(option.hint)
        if choices is not None:
            help_text = f"{help_text} [{'|'.join(map(str, choices))}]".strip()
        rows.append((flag_name(option.name), shown_default(option), help_text))
    return rows
