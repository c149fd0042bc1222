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

:mod:`~lmcompress.compressor.formats.registry` maps ``format`` to the class (a format registers
itself with ``register_format`` where it is defined); export and load look formats up through
:mod:`~lmcompress.compressor.formats.catalog` and nowhere else.

Some compression is not a layer: an 8-bit softmax changes every attention module. A
:class:`ModelTransform` is such a change, installed on a model (``install``) and stored and
replayed like a format (``kind``, ``state_tensors``, ``meta``, ``from_state``), registered with
``register_transform``. Export records the transforms installed on a model (:func:`installed`), and
reloading installs them again.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from lmcompress.errors import ModelLoadError
from lmcompress.kernels import cpu_kernels


def check_finite(format_name: str, tensors: dict[str, torch.Tensor | None]) -> None:
    """A :class:`ModelLoadError` naming the tensor unless every value of every floating tensor
    is finite (a NaN or inf weight would only show as a NaN perplexity). Meta tensors (a
    skeleton, filled later) are skipped: their loader checks them once loaded."""
    for key, tensor in tensors.items():
        if tensor is None or tensor.is_meta or not tensor.is_floating_point():
            continue
        if _all_finite(tensor):
            continue
        count = int((~torch.isfinite(tensor)).sum())
        if count:
            raise ModelLoadError(
                f"{format_name} tensor {key} holds {count} non-finite value(s) (nan or inf)"
            )


def _all_finite(tensor: torch.Tensor) -> bool:
    """One fast pass: the compiled CPU kernel where it reads the tensor, else a float32 sum (a
    NaN or inf anywhere makes it non-finite; an absurd |value| ~1e38 overflowing it sends the
    caller to the exact count)."""
    if (
        tensor.device.type == "cpu"
        and tensor.dtype in cpu_kernels.FLOAT_KINDS
        and cpu_kernels.library() is not None
    ):
        return cpu_kernels.all_finite(tensor)
    return bool(torch.isfinite(tensor.sum(dtype=torch.float32)))


class CompressedLinear(nn.Module):
    """Base class of compressed replacements for a linear layer (see the module doc).

    ``in_features`` / ``out_features`` are those of the layer it replaces; ``conv1d`` records
    that the original was GPT-2's ``Conv1D`` (weight stored ``(in, out)``), so that
    :meth:`to_dense` gives back the same kind of module.
    """

    format: ClassVar[str] = ""
    # Tensors stored in their own dtype whatever the save dtype (quantization scales: a bf16
    # scale would change every dequantized value).
    exact_tensors: ClassVar[frozenset[str]] = frozenset()
    # The other tools' layout the dense copy is written in when every compressed layer of a
    # model names the same one (``"compressed-tensors"`` for int8); None: plain dense weights.
    interop: ClassVar[str | None] = None
    # What it stores (:class:`~lmcompress.compressor.formats.schema.Schema`): its meta fields
    # and tensors, dtypes, shapes and value ranges; ``from_state`` checks against it.
    schema: ClassVar[Any] = None

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

    def expanded(self) -> nn.Module:
        """The ``expanded`` runtime's module: the same function from storage that its matmul
        reads without unpacking on every call, at the memory that costs. A format whose storage
        already is that (int8 codes, low-rank factors) returns itself; a packed one unpacks once
        (:class:`~lmcompress.compressor.formats.nm_packed.PackedNMLinear`: a dense linear of its
        values' dtype; ``nm_packed_int8``: the unpacked int8 codes)."""
        return self

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


# --- model-level transforms -----------------------------------------------------------------

_INSTALLED = "_lmcompress_transforms"  # attribute of a model: its installed transforms


class ModelTransform:
    """A change to a whole model that is not a replaced layer (see the module doc).

    Subclasses set ``kind`` and implement :meth:`state_tensors`, :meth:`meta`,
    :meth:`from_state`, :meth:`_install` and :meth:`_remove`; :meth:`install` records the
    transform on the model so that export finds it."""

    kind: ClassVar[str] = ""

    def state_tensors(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def meta(self) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def from_state(cls, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> ModelTransform:
        raise NotImplementedError

    def install(self, model: nn.Module) -> ModelTransform:
        """Apply to ``model`` until :meth:`remove`; returns ``self``."""
        self._install(model)
        installed(model).append(self)
        return self

    def remove(self, model: nn.Module) -> None:
        self._remove(model)
        installed(model).remove(self)

    def _install(self, model: nn.Module) -> None:
        raise NotImplementedError

    def _remove(self, model: nn.Module) -> None:
        raise NotImplementedError


def installed(model: nn.Module) -> list[ModelTransform]:
    """The transforms installed on ``model``, in order (a live list)."""
    if _INSTALLED not in model.__dict__:
        model.__dict__[_INSTALLED] = []
    return model.__dict__[_INSTALLED]
