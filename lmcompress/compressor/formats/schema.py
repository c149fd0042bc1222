"""What a format stores, declared: its manifest ``meta`` fields and its stored tensors.

Each format (:class:`~lmcompress.compressor.formats.base.CompressedLinear` subclass) sets a
:class:`Schema`; ``from_state`` checks what it is given against it (:meth:`Schema.check`) before
building anything, so that every reader of an export (``load_compressed`` in every runtime,
``compress-model eval`` and ``bench``, transformers' ``from_pretrained`` through the quantizer)
refuses a tampered file in one line instead of computing with it:

- ``meta``: each field's type (``bool`` is no ``int``), whether it is required, its choices or
  minimum, and cross-field rules (``n < m``, a group size dividing ``in_features``);
- tensors: the exact set of names (one missing or one the format does not know is refused),
  each one's dtype (a torch dtype, :data:`FLOAT`: the export's floating dtype, or
  :data:`EXACT`: float32 whatever the export's dtype), its shape as a function of the meta, and
  its values where they have a range (finite; strictly positive for scales).

The value checks read each tensor once with a vectorised or compiled pass (no Python loop over
elements); meta tensors (a skeleton that transformers fills later) skip them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from lmcompress.compressor.formats import quant
from lmcompress.compressor.formats.base import check_finite
from lmcompress.errors import LmcompressError, ModelLoadError, shown

FLOAT = "float"  # stored in the export's floating dtype (the save dtype)
EXACT = "float32"  # stored as float32 at any save dtype (a format's ``exact_tensors``)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
FLOAT_NAMES = tuple(str(d).removeprefix("torch.") for d in FLOAT_DTYPES)

Meta = Mapping[str, Any]


def always(_meta: Meta) -> bool:
    return True


@dataclass(frozen=True)
class MetaField:
    """One ``meta`` field: its allowed Python types, required or not, choices, minimum."""

    types: tuple[type, ...]
    required: bool = True
    choices: tuple[Any, ...] | None = None
    minimum: int | None = None

    def problem(self, value: Any) -> str | None:
        """Why ``value`` is not allowed, or ``None``."""
        if value is None and type(None) in self.types:
            return None
        if isinstance(value, bool) and bool not in self.types or not isinstance(value, self.types):
            names = "/".join("null" if t is type(None) else t.__name__ for t in self.types)
            return f"is {shown(value)}, expected {names}"
        if self.choices is not None and value not in self.choices:
            return f"is {shown(value)}, expected one of {', '.join(map(str, self.choices))}"
        if self.minimum is not None and value < self.minimum:
            return f"is {value}, expected >= {self.minimum}"
        return None


def positive_int(required: bool = True) -> MetaField:
    return MetaField((int,), required=required, minimum=1)


@dataclass(frozen=True)
class StoredTensor:
    """One stored tensor: dtype (a torch dtype, :data:`FLOAT` or :data:`EXACT`), shape as a
    function of the checked meta, when it is present (``None``: optional; a function: present
    exactly when it returns true), and its value range."""

    dtype: torch.dtype | str
    shape: Callable[[Meta], tuple[int, ...]]
    present: Callable[[Meta], bool] | None = always
    finite: bool = True  # floating values only
    positive: bool = False  # a scale: finite and > 0

    def dtype_problem(self, dtype: torch.dtype) -> str | None:
        if self.dtype == FLOAT:
            ok = dtype in FLOAT_DTYPES
        elif self.dtype == EXACT:
            ok = dtype == torch.float32
        else:
            ok = dtype == self.dtype
        return None if ok else f"is {str(dtype).removeprefix('torch.')}, expected {self.wanted}"

    @property
    def wanted(self) -> str:
        if self.dtype == FLOAT:
            return "a floating dtype (" + "/".join(FLOAT_NAMES) + ")"
        return str(self.dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Schema:
    """A format's ``meta`` fields and stored tensors (see the module doc). ``rules``: checks
    across fields, each ``meta -> problem or None``, run once every field has its type."""

    meta: dict[str, MetaField]
    tensors: dict[str, StoredTensor]
    rules: tuple[Callable[[Meta], str | None], ...] = field(default=())

    def check_meta(self, name: str, meta: Meta) -> None:
        """Every declared field of ``meta`` of its type, every required one present."""
        if not isinstance(meta, Mapping):
            raise ModelLoadError(f"{name} layer: meta is {shown(meta)}, expected an object")
        for key, spec in self.meta.items():
            if key not in meta:
                if spec.required:
                    raise ModelLoadError(f"{name} layer: meta field {key} is missing")
                continue
            if why := spec.problem(meta[key]):
                raise ModelLoadError(f"{name} layer: meta field {key} {why}")
        for rule in self.rules:
            if why := rule(meta):
                raise ModelLoadError(f"{name} layer: {why}")

    def expected(self, meta: Meta) -> tuple[set[str], set[str]]:
        """``(required, allowed)`` tensor names for ``meta`` (checked)."""
        required = {k for k, t in self.tensors.items() if t.present and t.present(meta)}
        allowed = {k for k, t in self.tensors.items() if t.present is None} | required
        return required, allowed

    def check(self, name: str, tensors: Mapping[str, torch.Tensor | None], meta: Meta) -> None:
        """``meta`` and ``tensors`` (``None`` values: absent) against the schema: fields, the
        set of names, dtypes, shapes, then values (finite, positive scales). ``name`` leads
        every message (``nm_packed``, ``int8``)."""
        self.check_meta(name, meta)
        given = {k for k, t in tensors.items() if t is not None}
        required, allowed = self.expected(meta)
        if missing := sorted(required - given):
            raise ModelLoadError(f"{name} layer is missing tensor {', '.join(missing)}")
        if unknown := sorted(given - allowed):
            raise ModelLoadError(
                f"{name} layer: unexpected tensor {', '.join(unknown)} (it needs "
                f"{', '.join(sorted(required))})"
            )
        for key in sorted(given):
            spec, tensor = self.tensors[key], tensors[key]
            if tuple(tensor.shape) != (want := spec.shape(meta)):
                raise ModelLoadError(
                    f"{name} {key} has shape {list(tensor.shape)}, expected {list(want)}"
                )
            if why := spec.dtype_problem(tensor.dtype):
                raise ModelLoadError(f"{name} {key} {why}")
        self.check_values(name, {k: tensors[k] for k in given})

    def check_values(self, name: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """Finite floating values; scales finite and > 0 (meta tensors skipped)."""
        finite = {k: t for k, t in tensors.items() if self.tensors[k].finite}
        check_finite(name, {k: t for k, t in finite.items() if not self.tensors[k].positive})
        for key, tensor in tensors.items():
            if self.tensors[key].positive and not tensor.is_meta:
                try:
                    quant.check_scale(tensor, f"{name} {key}")
                except LmcompressError as err:
                    raise ModelLoadError(str(err)) from None

    def check_stored_dtypes(
        self, name: str, tensors: Mapping[str, torch.Tensor | None], dtype: torch.dtype
    ) -> None:
        """Every :data:`FLOAT` tensor in the export's dtype ``dtype`` (what the model is built
        in: a float16 factor in a float32 export would fail in the first forward)."""
        for key, tensor in tensors.items():
            spec = self.tensors.get(key)
            if tensor is not None and spec is not None and spec.dtype == FLOAT:
                if tensor.dtype != dtype:
                    raise ModelLoadError(
                        f"{name} {key} is {str(tensor.dtype).removeprefix('torch.')}, but the "
                        f"export's dtype is {str(dtype).removeprefix('torch.')}"
                    )


# --- pieces the formats share ---------------------------------------------------------------

LINEAR_META = {
    "in_features": positive_int(),
    "out_features": positive_int(),
    "conv1d": MetaField((bool,), required=False),
}
NM_META = {"n": positive_int(), "m": MetaField((int,), minimum=2)}


def nm_rule(meta: Meta) -> str | None:
    n, m, in_features = meta["n"], meta["m"], meta["in_features"]
    if not n < m <= 256 or in_features % m:
        return f"invalid {n}:{m} for in_features={in_features}"
    return None


def bias_tensor(present: Callable[[Meta], bool] | None = None) -> StoredTensor:
    """The original layer's bias (out,), in the export's dtype (``present`` ``None``:
    optional)."""
    return StoredTensor(FLOAT, lambda meta: (meta["out_features"],), present=present)
