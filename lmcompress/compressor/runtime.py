"""Compressed runtime modules: what a compressed linear layer *is* at run time and on disk.

Every compressed form is a module that stands where an ``nn.Linear`` (or GPT-2's ``Conv1D``)
stood, and follows one small protocol:

- ``format``: the name it is stored under (``nm_packed``, ``low_rank``, ``int8``, ...);
- ``from_linear(linear, **options)``: compress a dense layer;
- ``state_tensors()`` / ``meta()``: the tensors and the JSON-serialisable metadata that
  ``from_state(tensors, meta)`` needs to rebuild the module (and nothing else);
- ``dense_weight()``: the ``(out, in)`` weight it computes with, for ``to_dense()``, which
  gives back a plain layer of the original kind (the copy that plain ``transformers`` loads);
- ``forward``.

:data:`FORMATS` maps ``format`` to the class; export and load look formats up there and
nowhere else. A format registers itself with :func:`register_format` where it is defined.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from lmcompress.errors import ModelLoadError

FORMATS: dict[str, type[CompressedLinear]] = {}


def register_format(cls: type[CompressedLinear]) -> type[CompressedLinear]:
    """Class decorator: make ``cls`` loadable under ``cls.format``."""
    if not cls.format:
        raise TypeError(f"{cls.__name__} has no format name")
    FORMATS[cls.format] = cls
    return cls


def format_class(name: str) -> type[CompressedLinear]:
    """The class stored under ``name``; a one-line error for an unknown (foreign, newer)
    format."""
    _import_builtin_formats()
    if name not in FORMATS:
        raise ModelLoadError(
            f"unknown compressed format {name!r}; known: {', '.join(sorted(FORMATS))}"
        )
    return FORMATS[name]


def _import_builtin_formats() -> None:
    """The formats lmcompress ships register on import; import them on first lookup."""
    import lmcompress.compressor.formats  # noqa: F401


class CompressedLinear(nn.Module):
    """Base class of compressed replacements for a linear layer (see the module doc).

    ``in_features`` / ``out_features`` are those of the layer it replaces; ``conv1d`` records
    that the original was GPT-2's ``Conv1D`` (weight stored ``(in, out)``), so that
    :meth:`to_dense` gives back the same kind of module.
    """

    format: ClassVar[str] = ""

    def __init__(self, in_features: int, out_features: int, conv1d: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features, self.conv1d = in_features, out_features, conv1d

    # --- the protocol ---------------------------------------------------------------------

    @classmethod
    def from_linear(cls, linear: nn.Module, **options: Any) -> CompressedLinear:
        raise NotImplementedError

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors to store (keyed by short names, e.g. ``values``, ``indices``, ``bias``)."""
        raise NotImplementedError

    def meta(self) -> dict[str, Any]:
        """JSON-serialisable options that, with :meth:`state_tensors`, rebuild the module."""
        return {
            "in_features": self.in_features,
            "out_features": self.out_features,
            "conv1d": self.conv1d,
        }

    @classmethod
    def from_state(cls, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> CompressedLinear:
        raise NotImplementedError

    def dense_weight(self) -> torch.Tensor:
        """The ``(out, in)`` weight this module computes with."""
        raise NotImplementedError

    @property
    def bias_tensor(self) -> torch.Tensor | None:
        return getattr(self, "bias", None)

    # --- shared ---------------------------------------------------------------------------

    @torch.no_grad()
    def to_dense(self) -> nn.Module:
        """A plain ``nn.Linear`` (or ``Conv1D``) computing the same function."""
        W = self.dense_weight()  # (out, in)
        bias = self.bias_tensor
        if self.conv1d:
            layer = Conv1D(self.out_features, self.in_features)
            layer.weight = nn.Parameter(W.t().contiguous(), requires_grad=False)
            if bias is None:  # Conv1D always has a bias
                bias = torch.zeros(self.out_features, dtype=W.dtype, device=W.device)
        else:
            layer = nn.Linear(
                self.in_features, self.out_features, bias=bias is not None, device="meta"
            )
            layer.weight = nn.Parameter(W.contiguous(), requires_grad=False)
        if bias is not None:
            layer.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
        return layer

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"
