"""Config dataclasses as options: what every field means beyond its type, the checks every config
runs on construction, and the recipe / command-line text of a config.

Three kinds of field annotation mean something beyond their type:

- ``Literal["a", "b"]``: the allowed values, in one place. Construction checks them
  (:func:`check_choices`) and the flag generator (``lmcompress.cli.flags``) turns them into
  argparse ``choices``.
- a *value type*: a class with a ``parse`` classmethod (``Sparsity``). Recipes and flags give
  its text form (``"2:4"``); the config stores it parsed and writes the text back.
- an *option group*: any other dataclass (``training: TrainingOptions``). Its fields are
  options of the outer config under their own names (flat flags ``--steps``, flat recipe keys),
  so moving options into a shared group changes neither the CLI nor the recipes.

:func:`changed_flags` and :func:`command_line` are the inverse of the flag generator: the
command that runs a config again, which every export records for its model card.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import shlex
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from lmcompress.errors import ConfigError, cut, shown


def is_value_type(hint: Any) -> bool:
    """A class stored parsed and written as text (``Sparsity``): it has a ``parse`` classmethod."""
    return isinstance(hint, type) and callable(getattr(hint, "parse", None))


def is_option_group(hint: Any) -> bool:
    """A nested dataclass whose fields are options of the outer config."""
    return isinstance(hint, type) and dataclasses.is_dataclass(hint) and not is_value_type(hint)


def literal_choices(hint: Any) -> tuple[Any, ...] | None:
    """The allowed values of ``Literal[...]`` (also inside ``X | None``), else ``None``."""
    if typing.get_origin(hint) is Literal:
        return typing.get_args(hint)
    inner = [a for a in typing.get_args(hint) if a is not type(None)]
    if _is_union(hint) and len(inner) == 1:
        return literal_choices(inner[0])
    return None


def _is_union(hint: Any) -> bool:
    origin = typing.get_origin(hint)
    return origin is typing.Union or str(origin) == "<class 'types.UnionType'>"


@dataclass(frozen=True)
class OptionField:
    """One option of a config class, option groups flattened: ``path`` is where it lives
    (``("training", "steps")``), ``name`` its flag and recipe key (``steps``)."""

    name: str
    path: tuple[str, ...]
    field: dataclasses.Field
    hint: Any
    default: Any  # dataclasses.MISSING when required


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


hints_of = functools.cache(typing.get_type_hints)  # per class: resolving annotations is slow


@functools.cache
def option_fields(cls: type) -> tuple[OptionField, ...]:
    """Every option of ``cls`` in field order, option groups flattened. A name that appears
    twice (an outer field and a group's field) is an error: flags and recipe keys are flat."""
    hints = hints_of(cls)
    out: list[OptionField] = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        hint, default = hints[f.name], _default(f)
        if is_option_group(hint):
            for sub in option_fields(hint):
                sub_default = (
                    sub.default
                    if default is dataclasses.MISSING
                    else functools.reduce(getattr, sub.path, default)
                )
                out.append(
                    OptionField(sub.name, (f.name, *sub.path), sub.field, sub.hint, sub_default)
                )
        else:
            out.append(OptionField(f.name, (f.name,), f, hint, default))
    seen: set[str] = set()
    for option in out:
        if option.name in seen:
            raise TypeError(
                f"{cls.__name__}: option {option.name!r} is defined twice (options of nested "
                "groups become flat flags and recipe keys, so names must be unique)"
            )
        seen.add(option.name)
    return tuple(out)


def option_value(config: Any, option: OptionField) -> Any:
    return functools.reduce(getattr, option.path, config)


def check_choices(config: Any) -> None:
    """Raise ``ConfigError`` for a ``Literal`` field (nested ones too) holding another value."""
    for option in option_fields(type(config)):
        choices = literal_choices(option.hint)
        value = option_value(config, option)
        if choices is None or value in choices or (value is None and _is_union(option.hint)):
            continue
        raise ConfigError(
            f"{option.name} must be one of {', '.join(map(str, choices))}, got {shown(value)}"
        )


_WRONG = object()  # a value that does not fit its annotation


_ABSENT = object()  # an option of a group given as a mapping without it


def check_types(config: Any) -> None:
    """Raise ``ConfigError`` naming the option whose value does not fit its annotation.

    Recipes come from YAML/JSON, where any value can have any type: call this first in the
    ``__post_init__`` of any (frozen) dataclass, before a value is compared or iterated. It
    stores the dataclass's own fields normalised (int for float: a float; list: a tuple); an
    option group normalises its fields by calling it in its own ``__post_init__``. ``Literal``
    values are left to :func:`check_choices`; value types (``Sparsity``) take text, a number or
    an instance. Numbers as text count: YAML 1.1 reads ``lr: 2e-4`` as the text ``"2e-4"``."""
    for option in option_fields(type(config)):
        value = _given(config, option)
        if value is _ABSENT:
            continue
        fitted = _fit(value, option.hint)
        if fitted is _WRONG:
            got = _as_written(value, option.hint)
            raise ConfigError(f"{option.name} must be {_expected(option.hint)}, got {got}")
        if len(option.path) == 1 and fitted is not value:  # a group normalises its own fields
            object.__setattr__(config, option.name, fitted)


def _given(config: Any, option: OptionField) -> Any:
    """The option's value; an option group may still be the mapping a recipe gave."""
    value, owner = config, type(config)
    for depth, name in enumerate(option.path):
        value = value.get(name, _ABSENT) if isinstance(value, Mapping) else getattr(value, name)
        if value is _ABSENT or depth == len(option.path) - 1:
            return value
        owner = hints_of(owner)[name]  # a group: its instance or a mapping of its options
        if isinstance(value, Mapping):
            unknown = sorted(set(map(str, value)) - {o.name for o in option_fields(owner)})
            if unknown:
                raise ConfigError(f"unknown option(s) in {name}: {cut(', '.join(unknown))}")
        elif not isinstance(value, owner):
            raise ConfigError(f"{name} must be a mapping of options, got {shown(value)}")
    return value


def _fit(value: Any, hint: Any) -> Any:
    """``value`` normalised to ``hint``, or ``_WRONG``."""
    if typing.get_origin(hint) is Literal or hint is Any:
        return value
    if _is_union(hint):  # None fits NoneType below
        fits = (_fit(value, a) for a in typing.get_args(hint))
        return next((f for f in fits if f is not _WRONG), _WRONG)
    if isinstance(value, bool):  # an int subclass: only a bool option takes it
        return value if hint is bool else _WRONG
    if hint in (int, float):
        try:  # text too; int() refuses "1.5" and 1.5, float() "many" and 10**400
            number = hint(value.strip()) if isinstance(value, str) else value
            if hint is int:
                return number if isinstance(number, int) else _WRONG
            ok = isinstance(number, (int, float)) and math.isfinite(float(number))
        except (ValueError, OverflowError):
            return _WRONG
        return float(number) if ok else _WRONG
    if is_value_type(hint):
        return value if isinstance(value, (hint, str, int, float)) else _WRONG
    if typing.get_origin(hint) is tuple:
        if not isinstance(value, (list, tuple)):
            return _WRONG
        args = typing.get_args(hint)
        hints = args[:1] * len(value) if args[-1:] == (Ellipsis,) else args
        if len(hints) != len(value):
            return _WRONG
        fitted = tuple(_fit(v, h) for v, h in zip(value, hints, strict=True))
        return _WRONG if any(f is _WRONG for f in fitted) else fitted
    if isinstance(hint, type):
        return value if isinstance(value, hint) else _WRONG
    return value  # an annotation this module does not know: the config's own checks decide


def _as_written(value: Any, hint: Any) -> str:
    """A wrong value as a recipe spells it (lists, null, true), with the usual slip named;
    at most a line's worth of it (:func:`~lmcompress.errors.shown`), however large it is."""
    if isinstance(value, str) and typing.get_origin(hint) is tuple:
        return f"the string {shown(value)} (write {cut(f'[{value}]')})"
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return shown(list(value) if isinstance(value, tuple) else value)


_NAMED = {int: "an integer", float: "a finite number", str: "a string", bool: "true or false"}


_PLURAL = {int: "integers", float: "numbers", str: "strings", bool: "true/false values"}


def _expected(hint: Any) -> str:
    """What an annotation asks for, as a recipe writer reads it."""
    args = typing.get_args(hint)
    if _is_union(hint):
        text = " or ".join(_expected(a) for a in args if a is not type(None))
        return f"{text} or null" if type(None) in args else text
    if typing.get_origin(hint) is tuple:
        if args[-1:] == (Ellipsis,):
            return f"a list of {_PLURAL.get(args[0], 'values')}"
        kind = _PLURAL.get(args[0], "values") if len(set(args)) == 1 else "values"
        return f"a list of {len(args)} {kind}"
    return _NAMED.get(hint) or getattr(hint, "expected", None) or f"a {hint!r}"


def recipe_value(value: Any) -> Any:
    """A field value as a recipe holds it: tuples as lists, value types as their text."""
    if isinstance(value, tuple):
        return [recipe_value(v) for v in value]
    return str(value) if is_value_type(type(value)) else value


def build_options(cls: type, values: Mapping[str, Any], base: Any = None) -> Any:
    """An instance of ``cls`` from flat ``values``; fields not given keep ``base``'s values
    (the outer config's default for a group), else the class defaults."""
    hints = hints_of(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        hint = hints[f.name]
        if is_option_group(hint):
            names = {o.name for o in option_fields(hint)}
            sub = {k: v for k, v in values.items() if k in names}
            if sub:
                group_base = getattr(base, f.name) if base is not None else _default(f)
                kwargs[f.name] = build_options(
                    hint, sub, None if group_base is dataclasses.MISSING else group_base
                )
        elif f.name in values:
            value = values[f.name]
            kwargs[f.name] = tuple(value) if isinstance(value, list) else value
    return dataclasses.replace(base, **kwargs) if base is not None else cls(**kwargs)


def flat_option_groups(cls: type) -> type:
    """Class decorator for a config dataclass with option groups (``training:
    TrainingOptions``): its constructor (hence ``dataclasses.replace``) also takes a group's
    options as flat keywords, which override those of the group given (or of the field's
    default, e.g. SGD for ASLP). Recipes and flags speak flat keys too (``MethodConfig``
    flattens option groups); the config still holds one source per option, the group."""
    hints = hints_of(cls)
    groups = [f for f in dataclasses.fields(cls) if f.init and is_option_group(hints[f.name])]
    if not groups:
        raise TypeError(f"{cls.__name__} has no option group")
    names = {f.name: {o.name for o in option_fields(hints[f.name])} for f in groups}
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        for f in groups:
            flat = {k: kwargs.pop(k) for k in list(kwargs) if k in names[f.name]}
            group = kwargs.get(f.name)
            group = _default(f) if group is None else group
            if not isinstance(group, hints[f.name]):
                raise ConfigError(
                    f"{f.name} must be {hints[f.name].__name__}, got {type(group).__name__}"
                )
            kwargs[f.name] = dataclasses.replace(group, **flat)
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def changed_flags(config: Any, skip: tuple[str, ...] = ()) -> list[str]:
    """The flags that rebuild ``config`` (a config dataclass) from its defaults: one per option
    whose value differs from the default (``--sparsity 2:4``, ``--no-dense-copy``, ``--eval a
    b``), the inverse of :func:`add_dataclass_flags`. A required option is always given."""
    argv: list[str] = []
    for option in option_fields(type(config)):
        if option.name in skip:
            continue
        value = recipe_value(option_value(config, option))
        default = option.default
        if default is not dataclasses.MISSING and value == recipe_value(default):
            continue
        flag = flag_name(option.name)
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]
        elif value is not None:  # None differing from a default: no flag spells it
            argv += [flag, str(value)]
    return argv


def command_line(prog: str, checkpoint: str, method: str, *configs: Any) -> str:
    """The shell command that runs ``configs`` again: ``prog CHECKPOINT --method M`` plus
    :func:`changed_flags` of each config (``-o`` written short, ``--overwrite`` left out)."""
    argv = [prog, checkpoint, "--method", method]
    for config in configs:
        argv += changed_flags(config, skip=("checkpoint", "overwrite"))
    return shlex.join(["-o" if arg == "--output" else arg for arg in argv])
