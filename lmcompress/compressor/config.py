"""Configs shared by every method: frozen dataclasses validated on construction.

A method's config subclasses :class:`MethodConfig`; its fields become CLI flags (see
``lmcompress.cli.flags``) and :meth:`MethodConfig.to_dict` is the recipe that
``compression.json`` records. Field metadata: see ``lmcompress.cli.flags``.

Three kinds of field annotation mean something beyond their type:

- ``Literal["a", "b"]``: the allowed values, in one place. Construction checks them
  (:func:`check_choices`) and the flag generator turns them into argparse ``choices``.
- a *value type*: a class with a ``parse`` classmethod (:class:`Sparsity`). Recipes and flags
  give its text form (``"2:4"``); the config stores it parsed and writes the text back.
- an *option group*: any other dataclass (``training: TrainingOptions``). Its fields are
  options of the outer config under their own names (flat flags ``--steps``, flat recipe keys),
  so moving options into a shared group changes neither the CLI nor the recipes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from lmcompress.errors import ConfigError


@dataclass(frozen=True)
class Sparsity:
    """Either an N:M pattern (``n`` of every ``m`` consecutive input weights kept)
    or an unstructured ratio of weights removed. Always valid once constructed."""

    expected: ClassVar[str] = "an N:M pattern or a ratio removed (e.g. 2:4 or 0.5)"

    n: int = 0
    m: int = 0
    ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.m or self.n:
            if not 0 < self.n < self.m:
                raise ConfigError(f"impossible N:M sparsity {self.n}:{self.m}: need 0 < N < M")
        elif not 0.0 < self.ratio < 1.0:
            raise ConfigError(f"sparsity ratio {self.ratio!r} must lie strictly between 0 and 1")

    @classmethod
    def parse(cls, value: str | float | Sparsity) -> Sparsity:
        return parse_sparsity(value)

    @property
    def is_nm(self) -> bool:
        return self.m > 0

    @property
    def fraction_removed(self) -> float:
        return 1.0 - self.n / self.m if self.is_nm else self.ratio

    def __str__(self) -> str:
        return f"{self.n}:{self.m}" if self.is_nm else f"{self.ratio:g}"


_NM = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*$")


def parse_sparsity(value: str | float | Sparsity) -> Sparsity:
    """Parse ``"2:4"`` (N:M, keep N of every M) or ``"0.5"`` / ``"50%"`` (fraction removed)."""
    if isinstance(value, Sparsity):
        return value
    text = str(value).strip()
    match = _NM.match(text)
    if match:
        n, m = int(match.group(1)), int(match.group(2))
        if not 0 < n < m:
            raise ConfigError(f"impossible N:M sparsity {text!r}: need 0 < N < M")
        return Sparsity(n=n, m=m)
    try:
        ratio = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise ConfigError(
            f"sparsity {text!r} is neither N:M (e.g. 2:4) nor a ratio in (0, 1) (e.g. 0.5)"
        ) from None
    if not 0.0 < ratio < 1.0:
        raise ConfigError(
            f"sparsity ratio {text!r} must lie strictly between 0 and 1{_sexagesimal_hint(value)}"
        )
    return Sparsity(ratio=ratio)


def _sexagesimal_hint(value: Any) -> str:
    """YAML 1.1 (PyYAML) reads an unquoted ``2:4`` as the base-60 integer 124: say so."""
    if type(value) is not int or value < 60:
        return ""
    high, low = divmod(value, 60)
    return f' (YAML reads an unquoted {high}:{low} as the number {value}: quote it, "{high}:{low}")'


# --- what an annotation means -------------------------------------------------------------------


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


_hints = functools.cache(typing.get_type_hints)  # per class: resolving annotations is slow


@functools.cache
def option_fields(cls: type) -> tuple[OptionField, ...]:
    """Every option of ``cls`` in field order, option groups flattened. A name that appears
    twice (an outer field and a group's field) is an error: flags and recipe keys are flat."""
    hints = _hints(cls)
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
            f"{option.name} must be one of {', '.join(map(str, choices))}, got {value!r}"
        )


# --- the types of option values ---------------------------------------------------------------

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
        owner = _hints(owner)[name]  # a group: its instance or a mapping of its options
        if isinstance(value, Mapping):
            unknown = sorted(set(map(str, value)) - {o.name for o in option_fields(owner)})
            if unknown:
                raise ConfigError(f"unknown option(s) in {name}: {', '.join(unknown)}")
        elif not isinstance(value, owner):
            raise ConfigError(f"{name} must be a mapping of options, got {value!r}")
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
        try:  # text too; int() refuses "1.5" and 1.5, float() "many"
            number = hint(value.strip()) if isinstance(value, str) else value
        except ValueError:
            return _WRONG
        ok = isinstance(number, int if hint is int else (int, float)) and math.isfinite(number)
        return hint(number) if ok else _WRONG
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
    """A wrong value as a recipe spells it (lists, null, true), with the usual slip named."""
    if isinstance(value, str) and typing.get_origin(hint) is tuple:
        return f"the string {value!r} (write [{value}])"
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return repr(list(value)) if isinstance(value, tuple) else repr(value)


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


def _build(cls: type, values: Mapping[str, Any], base: Any = None) -> Any:
    """An instance of ``cls`` from flat ``values``; fields not given keep ``base``'s values
    (the outer config's default for a group), else the class defaults."""
    hints = _hints(cls)
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
                kwargs[f.name] = _build(
                    hint, sub, None if group_base is dataclasses.MISSING else group_base
                )
        elif f.name in values:
            value = values[f.name]
            kwargs[f.name] = tuple(value) if isinstance(value, list) else value
    return dataclasses.replace(base, **kwargs) if base is not None else cls(**kwargs)


@dataclass(frozen=True)
class MethodConfig:
    """Options every method has: which layers to compress.

    ``include`` / ``exclude`` are glob patterns on fully-qualified module names
    (``model.layers.*.mlp.*``). An empty ``include`` means every linear layer inside the
    decoder blocks; embeddings and ``lm_head`` are then left alone.
    """

    method: ClassVar[str] = ""

    include: tuple[str, ...] = field(
        default=(),
        metadata={"help": "glob(s) of module names to compress", "default_text": "decoder linears"},
    )
    exclude: tuple[str, ...] = field(
        default=(), metadata={"help": "glob(s) of module names to leave alone"}
    )

    def __post_init__(self) -> None:
        check_types(self)  # first (recipes are YAML/JSON); a group name clash fails here too
        hints = _hints(type(self))
        for f in dataclasses.fields(self):
            value, hint = getattr(self, f.name), hints[f.name]
            if is_value_type(hint) and value is not None:
                value = hint.parse(value)  # "2:4" -> Sparsity(2, 4), once
            elif is_option_group(hint) and isinstance(value, Mapping):
                value = _build(hint, value)
            object.__setattr__(self, f.name, value)
        check_choices(self)
        for pattern in (*self.include, *self.exclude):
            if not pattern:
                raise ConfigError(f"layer patterns must be non-empty strings, got {pattern!r}")

    def to_dict(self) -> dict[str, Any]:
        """The recipe: flat, JSON-serialisable option values, plus the method name."""
        out: dict[str, Any] = {"method": self.method}
        for option in option_fields(type(self)):
            out[option.name] = recipe_value(option_value(self, option))
        return out

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> MethodConfig:
        """Build from a recipe; unknown keys are an error, not silently ignored. Options of a
        group come as flat keys (as :meth:`to_dict` writes them) or as a mapping under the
        group's field name."""
        flat = {k: v for k, v in values.items() if k != "method"}
        hints = _hints(cls)
        for f in dataclasses.fields(cls):
            if is_option_group(hints[f.name]) and isinstance(flat.get(f.name), Mapping):
                group = flat.pop(f.name)
                twice = sorted(set(group) & set(flat))
                if twice:
                    raise ConfigError(f"option(s) given twice, flat and in {f.name}: {twice}")
                flat.update(group)
        names = {o.name for o in option_fields(cls)}
        unknown = sorted(set(flat) - names)
        if unknown:
            raise ConfigError(
                f"unknown option(s) for method {cls.method!r}: {', '.join(unknown)} "
                f"(known: {', '.join(sorted(names))})"
            )
        try:
            return _build(cls, flat)
        except TypeError as err:
            raise ConfigError(f"bad options for method {cls.method!r}: {err}") from None
