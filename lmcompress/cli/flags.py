"""CLI flags generated from config dataclasses: one flag per field, typed from its annotation."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any


def _field_kwargs(hint: Any) -> dict[str, Any]:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":  # X | None
        inner = [a for a in args if a is not type(None)]
        return _field_kwargs(inner[0]) if len(inner) == 1 else {"type": str}
    if hint is bool:
        return {"action": argparse.BooleanOptionalAction}
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return {"nargs": "*", "type": args[0]}  # `--eval` alone: none
        return {"nargs": len(args), "type": args[0]}
    if hint in (int, float, str):
        return {"type": hint}
    raise TypeError(f"no CLI flag for a field of type {hint!r}")


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def add_dataclass_flags(
    parser: argparse.ArgumentParser | Any,
    cls: type,
    skip: tuple[str, ...] = (),
    aliases: dict[str, str] | None = None,
) -> list[str]:
    """Add one flag per field of ``cls`` with ``default=SUPPRESS`` so that only the flags a
    user gave appear in the namespace (recipes fill the rest). ``aliases`` adds short flags
    (``{"output": "-o"}``). Returns the field names."""
    aliases = aliases or {}
    hints = typing.get_type_hints(cls)
    names = []
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        kwargs = _field_kwargs(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        shown = " ".join(map(str, default)) if isinstance(default, tuple) else default
        help_text = f.metadata.get("help", "")
        flags = [aliases[f.name]] if f.name in aliases else []
        parser.add_argument(
            *flags,
            flag_name(f.name),
            dest=f.name,
            default=argparse.SUPPRESS,
            help=f"{help_text} (default: {shown})" if help_text else f"(default: {shown})",
            metavar=None if "action" in kwargs else f.name.upper(),
            **kwargs,
        )
        names.append(f.name)
    return names


def describe(cls: type) -> list[tuple[str, str, str]]:
    """(flag, default, help) for every field, for ``compress-model methods``."""
    rows = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        rows.append((flag_name(f.name), repr(default), f.metadata.get("help", "")))
    return rows
