"""Configs shared by every method: frozen dataclasses validated on construction.

A method's config subclasses :class:`MethodConfig`; its fields become CLI flags (see
``lmcompress.cli``) and its ``asdict`` is the recipe that ``compression.json`` records.
Field metadata ``help`` is the flag's help text.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

from lmcompress.errors import ConfigError


@dataclass(frozen=True)
class Sparsity:
    """Either an N:M pattern (``n`` of every ``m`` consecutive input weights kept)
    or an unstructured ratio of weights removed."""

    n: int = 0
    m: int = 0
    ratio: float = 0.0

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
        raise ConfigError(f"sparsity ratio {text!r} must lie strictly between 0 and 1")
    return Sparsity(ratio=ratio)


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
        metadata={"help": "glob(s) of module names to compress (default: decoder linears)"},
    )
    exclude: tuple[str, ...] = field(
        default=(), metadata={"help": "glob(s) of module names to leave alone"}
    )

    def __post_init__(self) -> None:
        # Recipes come from YAML/JSON where sequences are lists: store tuples (hashable, frozen).
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, list):
                object.__setattr__(self, f.name, tuple(value))
        for pattern in (*self.include, *self.exclude):
            if not isinstance(pattern, str) or not pattern:
                raise ConfigError(f"layer patterns must be non-empty strings, got {pattern!r}")

    def to_dict(self) -> dict[str, Any]:
        """The recipe: JSON-serialisable field values, plus the method name."""
        out: dict[str, Any] = {"method": self.method}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> MethodConfig:
        """Build from a recipe; unknown keys are an error, not silently ignored."""
        values = {k: v for k, v in values.items() if k != "method"}
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ConfigError(
                f"unknown option(s) for method {cls.method!r}: {', '.join(unknown)} "
                f"(known: {', '.join(sorted(names))})"
            )
        try:
            return cls(**values)
        except TypeError as err:
            raise ConfigError(f"bad options for method {cls.method!r}: {err}") from None
