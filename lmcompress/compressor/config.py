"""Configs shared by every method: frozen dataclasses validated on construction.

A method's config subclasses :class:`MethodConfig`; its fields become CLI flags (see
``lmcompress.cli.flags``) and :meth:`MethodConfig.to_dict` is the recipe that
``compression.json`` records. What a field's annotation and metadata mean: see
:mod:`lmcompress.compressor.options`. :class:`Sparsity` is the value type every pruning method
takes.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from lmcompress.compressor.options import (
    build_options,
    check_choices,
    check_types,
    hints_of,
    is_option_group,
    is_value_type,
    option_fields,
    option_value,
    recipe_value,
)
from lmcompress.errors import ConfigError, cut, shown


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
            raise ConfigError(f"impossible N:M sparsity {shown(text)}: need 0 < N < M")
        return Sparsity(n=n, m=m)
    try:
        ratio = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise ConfigError(
            f"sparsity {shown(text)} is neither N:M (e.g. 2:4) nor a ratio in (0, 1) (e.g. 0.5)"
        ) from None
    if not 0.0 < ratio < 1.0:
        raise ConfigError(
            f"sparsity ratio {shown(text)} must lie strictly between 0 and 1"
            + _sexagesimal_hint(value)
        )
    return Sparsity(ratio=ratio)


def _sexagesimal_hint(value: Any) -> str:
    """YAML 1.1 (PyYAML) reads an unquoted ``2:4`` as the base-60 integer 124: say so."""
    if type(value) is not int or value < 60:
        return ""
    high, low = divmod(value, 60)
    return f' (YAML reads an unquoted {high}:{low} as the number {value}: quote it, "{high}:{low}")'


# --- what an annotation means -------------------------------------------------------------------


# --- the types of option values ---------------------------------------------------------------


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
        hints = hints_of(type(self))
        for f in dataclasses.fields(self):
            value, hint = getattr(self, f.name), hints[f.name]
            if is_value_type(hint) and value is not None:
                value = hint.parse(value)  # "2:4" -> Sparsity(2, 4), once
            elif is_option_group(hint) and isinstance(value, Mapping):
                value = build_options(hint, value)
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
        hints = hints_of(cls)
        for f in dataclasses.fields(cls):
            if is_option_group(hints[f.name]) and isinstance(flat.get(f.name), Mapping):
                group = flat.pop(f.name)
                twice = sorted(set(group) & set(flat))
                if twice:
                    raise ConfigError(
                        f"option(s) given twice, flat and in {f.name}: {shown(twice)}"
                    )
                flat.update(group)
        names = {o.name for o in option_fields(cls)}
        unknown = sorted(set(flat) - names)
        if unknown:
            raise ConfigError(
                f"unknown option(s) for method {cls.method!r}: {cut(', '.join(unknown))} "
                f"(known: {', '.join(sorted(names))})"
            )
        try:
            return build_options(cls, flat)
        except TypeError as err:
            raise ConfigError(f"bad options for method {cls.method!r}: {err}") from None
